#include "treeverify/services/grpc_rank_client.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "treeverify/kernels/status.h"
#include "treeverify/services/proto_conversion.h"
#include "treeverify/services/status_conversion.h"

namespace treeverify::services {

absl::StatusOr<std::unique_ptr<GrpcRankClient>> GrpcRankClient::Create(
    const std::string& address, const GrpcRankClientOptions& options) {
  TV_ASSIGN_OR_RETURN(std::shared_ptr<grpc::Channel> channel,
                      CreateClientChannel(address, options.max_message_bytes));
  return std::unique_ptr<GrpcRankClient>(
      new GrpcRankClient(address, v1::Worker::NewStub(std::move(channel))));
}

absl::Status GrpcRankClient::CallStatus(const grpc::Status& status,
                                        absl::string_view method) const {
  if (status.ok()) return absl::OkStatus();
  const absl::Status converted = ToAbslStatus(status);
  return absl::Status(converted.code(), absl::StrCat("Worker.", method, " on rank at ", address_,
                                                     ": ", converted.message()));
}

absl::StatusOr<coordinator::RankDescription> GrpcRankClient::Describe(absl::Duration timeout) {
  grpc::ClientContext context;
  SetTimeout(context, timeout);
  v1::DescribeResponse response;
  if (absl::Status status =
          CallStatus(stub_->Describe(&context, v1::DescribeRequest(), &response), "Describe");
      !status.ok()) {
    return status;
  }
  return RankDescriptionFromProto(response);
}

absl::StatusOr<worker::ForwardResult> GrpcRankClient::Forward(const worker::ForwardRequest& request,
                                                              absl::Duration timeout) {
  v1::ForwardRequest proto;
  ForwardRequestToProto(request, &proto);
  grpc::ClientContext context;
  SetTimeout(context, timeout);
  v1::ForwardResponse response;
  if (absl::Status status = CallStatus(stub_->Forward(&context, proto, &response), "Forward");
      !status.ok()) {
    return status;
  }
  absl::StatusOr<worker::ForwardResult> result = ForwardResultFromProto(response, request);
  if (!result.ok()) {
    return absl::Status(result.status().code(),
                        absl::StrCat("rank at ", address_, ": ", result.status().message()));
  }
  return result;
}

absl::StatusOr<int64_t> GrpcRankClient::Release(absl::Span<const uint64_t> sequence_ids,
                                                absl::Duration timeout) {
  v1::ReleaseRequest proto;
  proto.mutable_sequence_ids()->Add(sequence_ids.begin(), sequence_ids.end());
  grpc::ClientContext context;
  SetTimeout(context, timeout);
  v1::ReleaseResponse response;
  if (absl::Status status = CallStatus(stub_->Release(&context, proto, &response), "Release");
      !status.ok()) {
    return status;
  }
  return response.kv_pages_free();
}

}  // namespace treeverify::services
