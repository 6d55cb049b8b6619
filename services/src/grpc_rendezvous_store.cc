#include "treeverify/services/grpc_rendezvous_store.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "treeverify/services/client_channel.h"
#include "treeverify/services/status_conversion.h"

namespace treeverify::services {
namespace {

absl::Status CallStatus(const grpc::Status& status, absl::string_view method) {
  if (status.ok()) return absl::OkStatus();
  const absl::Status converted = ToAbslStatus(status);
  return absl::Status(converted.code(),
                      absl::StrCat("Rendezvous.", method, ": ", converted.message()));
}

}  // namespace

GrpcRendezvousStore::GrpcRendezvousStore(std::shared_ptr<grpc::Channel> channel,
                                         int64_t group_epoch,
                                         const GrpcRendezvousStoreOptions& options)
    : group_epoch_(group_epoch),
      options_(options),
      stub_(v1::Rendezvous::NewStub(std::move(channel))) {}

absl::Status GrpcRendezvousStore::Set(const std::string& key, const std::string& value) {
  v1::SetRequest request;
  request.set_group_epoch(group_epoch_);
  request.set_key(key);
  request.set_value(value);
  grpc::ClientContext context;
  context.set_wait_for_ready(true);
  SetTimeout(context, options_.call_timeout);
  v1::SetResponse response;
  return CallStatus(stub_->Set(&context, request, &response), "Set");
}

absl::StatusOr<std::vector<std::string>> GrpcRendezvousStore::Get(
    const std::vector<std::string>& keys, absl::Duration timeout) {
  timeout = std::max(timeout, absl::ZeroDuration());
  v1::GetRequest request;
  request.set_group_epoch(group_epoch_);
  for (const std::string& key : keys) request.add_keys(key);
  request.set_timeout_seconds(absl::ToDoubleSeconds(timeout));  // +inf for an infinite one
  grpc::ClientContext context;
  context.set_wait_for_ready(true);
  SetTimeout(context, timeout + options_.get_slack);
  v1::GetResponse response;
  if (absl::Status status = CallStatus(stub_->Get(&context, request, &response), "Get");
      !status.ok()) {
    return status;
  }
  if (response.values_size() != static_cast<int>(keys.size())) {
    return absl::InternalError(absl::StrCat("Rendezvous.Get returned ", response.values_size(),
                                            " values for ", keys.size(), " keys"));
  }
  return std::vector<std::string>(response.values().begin(), response.values().end());
}

absl::Status GrpcRendezvousStore::Join(int rank, int world_size, const std::string& address) {
  v1::JoinRequest request;
  request.set_group_epoch(group_epoch_);
  request.set_rank(rank);
  request.set_world_size(world_size);
  request.set_address(address);
  grpc::ClientContext context;
  context.set_wait_for_ready(true);
  SetTimeout(context, options_.call_timeout);
  v1::JoinResponse response;
  return CallStatus(stub_->Join(&context, request, &response), "Join");
}

}  // namespace treeverify::services
