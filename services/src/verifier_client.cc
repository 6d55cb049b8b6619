#include "treeverify/services/verifier_client.h"

#include <google/protobuf/io/coded_stream.h>
#include <google/protobuf/io/zero_copy_stream_impl_lite.h>
#include <google/protobuf/wire_format_lite.h>
#include <grpcpp/generic/generic_stub.h>

#include <algorithm>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "treeverify/kernels/status.h"
#include "treeverify/services/proto_conversion.h"
#include "treeverify/services/status_conversion.h"

namespace treeverify::services {
namespace {

// grpc.health.v1 messages, encoded by hand: the installed gRPC ships no generated code for them.
// HealthCheckRequest { string service = 1; }  HealthCheckResponse { ServingStatus status = 1; }
constexpr int kHealthServing = 1;

std::string EncodeHealthCheckRequest(const std::string& service) {
  std::string bytes;
  if (service.empty()) return bytes;
  google::protobuf::io::StringOutputStream output(&bytes);
  google::protobuf::io::CodedOutputStream coded(&output);
  google::protobuf::internal::WireFormatLite::WriteString(1, service, &coded);
  return bytes;
}

absl::StatusOr<int> DecodeHealthCheckResponse(const std::string& bytes) {
  google::protobuf::io::CodedInputStream input(reinterpret_cast<const uint8_t*>(bytes.data()),
                                               static_cast<int>(bytes.size()));
  int status = 0;
  while (const uint32_t tag = input.ReadTag()) {
    if (tag == google::protobuf::internal::WireFormatLite::MakeTag(
                   1, google::protobuf::internal::WireFormatLite::WIRETYPE_VARINT)) {
      uint32_t value = 0;
      if (!input.ReadVarint32(&value)) break;
      status = static_cast<int>(value);
    } else if (!google::protobuf::internal::WireFormatLite::SkipField(&input, tag)) {
      return absl::InternalError("malformed grpc.health.v1.HealthCheckResponse");
    }
  }
  return status;
}

}  // namespace

// ---------------------------------------------------------------------------------------------

VerifierStream::~VerifierStream() {
  if (!finished_) {
    context_.TryCancel();
    stream_->Finish().IgnoreError();
  }
}

absl::StatusOr<coordinator::VerifyOutput> VerifierStream::Step(
    const coordinator::VerifyInput& input) {
  if (finished_) {
    return absl::FailedPreconditionError(absl::StrCat(
        "the stream is over", final_status_.ok() ? "" : ": ", final_status_.message()));
  }
  v1::VerifyRequest request;
  VerifyInputToProto(input, &request);
  v1::VerifyResponse response;
  // A failed Write or Read means the server ended the stream: its status says why.
  if (!stream_->Write(request) || !stream_->Read(&response)) {
    absl::Status status = Finish();
    if (status.ok()) status = absl::UnavailableError("the server closed the stream");
    return status;
  }
  return VerifyOutputFromProto(response);
}

absl::Status VerifierStream::Finish() {
  if (finished_) return final_status_;
  finished_ = true;
  stream_->WritesDone();
  final_status_ = ToAbslStatus(stream_->Finish());
  return final_status_;
}

// ---------------------------------------------------------------------------------------------

VerifierClient::VerifierClient(std::shared_ptr<grpc::Channel> channel,
                               const VerifierClientOptions& options)
    : options_(options), channel_(std::move(channel)), stub_(v1::Verifier::NewStub(channel_)) {}

absl::StatusOr<std::unique_ptr<VerifierClient>> VerifierClient::Connect(
    const std::string& address, absl::Duration timeout, const VerifierClientOptions& options) {
  TV_ASSIGN_OR_RETURN(std::shared_ptr<grpc::Channel> channel,
                      CreateClientChannel(address, options.max_message_bytes));
  TV_RETURN_IF_ERROR(WaitForChannel(*channel, address, timeout));
  return std::unique_ptr<VerifierClient>(new VerifierClient(std::move(channel), options));
}

absl::StatusOr<coordinator::ModelInfo> VerifierClient::GetModelInfo() {
  grpc::ClientContext context;
  SetTimeout(context, options_.call_timeout);
  v1::GetModelInfoResponse response;
  TV_RETURN_IF_ERROR(
      ToAbslStatus(stub_->GetModelInfo(&context, v1::GetModelInfoRequest(), &response)));
  return ModelInfoFromProto(response);
}

absl::StatusOr<coordinator::CreateSessionOutput> VerifierClient::CreateSession(
    coordinator::CreateSessionInput input) {
  v1::CreateSessionRequest request;
  CreateSessionInputToProto(input, &request);
  grpc::ClientContext context;
  SetTimeout(context, options_.call_timeout);
  v1::CreateSessionResponse response;
  TV_RETURN_IF_ERROR(ToAbslStatus(stub_->CreateSession(&context, request, &response)));
  return CreateSessionOutputFromProto(response);
}

absl::StatusOr<coordinator::VerifyOutput> VerifierClient::Verify(coordinator::VerifyInput input) {
  v1::VerifyRequest request;
  VerifyInputToProto(input, &request);
  grpc::ClientContext context;
  SetTimeout(context, options_.call_timeout);
  v1::VerifyResponse response;
  TV_RETURN_IF_ERROR(ToAbslStatus(stub_->Verify(&context, request, &response)));
  return VerifyOutputFromProto(response);
}

absl::Status VerifierClient::CloseSession(const coordinator::SessionId& id) {
  v1::CloseSessionRequest request;
  request.set_session_id(id.ToHex());
  grpc::ClientContext context;
  SetTimeout(context, options_.call_timeout);
  v1::CloseSessionResponse response;
  return ToAbslStatus(stub_->CloseSession(&context, request, &response));
}

absl::StatusOr<std::unique_ptr<VerifierStream>> VerifierClient::OpenStream() {
  std::unique_ptr<VerifierStream> stream(new VerifierStream());
  stream->stream_ = stub_->VerifyStream(&stream->context_);
  if (stream->stream_ == nullptr) return absl::InternalError("could not start a VerifyStream");
  return stream;
}

absl::StatusOr<bool> VerifierClient::CheckHealth(const std::string& service) {
  const std::string encoded = EncodeHealthCheckRequest(service);
  grpc::Slice slice(encoded);
  grpc::ByteBuffer request(&slice, 1);
  grpc::ByteBuffer response;
  grpc::ClientContext context;
  SetTimeout(context, std::min(options_.call_timeout, absl::Seconds(5)));
  grpc::GenericStub generic(channel_);
  absl::Notification done;
  grpc::Status status;
  generic.UnaryCall(&context, "/grpc.health.v1.Health/Check", grpc::StubOptions(), &request,
                    &response, [&](grpc::Status s) {
                      status = std::move(s);
                      done.Notify();
                    });
  done.WaitForNotification();
  TV_RETURN_IF_ERROR(ToAbslStatus(status));
  std::vector<grpc::Slice> slices;
  if (!response.Dump(&slices).ok()) return absl::InternalError("unreadable health response");
  std::string bytes;
  for (const grpc::Slice& s : slices) {
    bytes.append(reinterpret_cast<const char*>(s.begin()), s.size());
  }
  TV_ASSIGN_OR_RETURN(int serving_status, DecodeHealthCheckResponse(bytes));
  return serving_status == kHealthServing;
}

absl::Status VerifierClient::WaitUntilServing(absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  absl::Status last = absl::UnavailableError("no answer yet");
  while (true) {
    absl::StatusOr<bool> serving = CheckHealth(v1::Verifier::service_full_name());
    if (serving.ok() && *serving) return absl::OkStatus();
    last = serving.ok() ? absl::UnavailableError("NOT_SERVING") : serving.status();
    if (absl::Now() >= deadline) break;
    absl::SleepFor(absl::Milliseconds(100));
  }
  return absl::DeadlineExceededError(absl::StrCat("the Verifier was not SERVING within ",
                                                  absl::FormatDuration(timeout),
                                                  " (last answer: ", last.ToString(), ")"));
}

}  // namespace treeverify::services
