#include "treeverify/services/server_bootstrap.h"

#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/health_check_service_interface.h>

#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "treeverify/kernels/status.h"

namespace treeverify::services {

absl::StatusOr<HostPort> ParseHostPort(absl::string_view address) {
  const auto invalid = [&] {
    return absl::InvalidArgumentError(absl::StrCat(
        "address \"", address, "\" must be host:port (IPv6 as [host]:port; port 0 picks one)"));
  };
  HostPort result;
  absl::string_view port;
  if (absl::StartsWith(address, "[")) {
    const size_t close = address.find(']');
    if (close == absl::string_view::npos || close + 1 >= address.size() ||
        address[close + 1] != ':') {
      return invalid();
    }
    result.host = std::string(address.substr(1, close - 1));
    port = address.substr(close + 2);
  } else {
    const size_t colon = address.rfind(':');
    if (colon == absl::string_view::npos) return invalid();
    result.host = std::string(address.substr(0, colon));
    if (absl::StrContains(result.host, ':')) return invalid();
    port = address.substr(colon + 1);
  }
  if (!absl::SimpleAtoi(port, &result.port) || result.port < 0 || result.port > 65535) {
    return invalid();
  }
  return result;
}

std::string JoinHostPort(absl::string_view host, int port) {
  if (absl::StrContains(host, ':')) return absl::StrCat("[", host, "]:", port);
  return absl::StrCat(host, ":", port);
}

bool IsWildcardHost(absl::string_view host) {
  return host.empty() || host == "0.0.0.0" || host == "::" || host == "[::]";
}

absl::Status ServerOptions::Validate() const {
  TV_RETURN_IF_ERROR(ParseHostPort(listen_address).status());
  TV_RETURN_IF_ERROR(ValidateMaxMessageBytes(max_message_bytes));
  if (max_concurrent_streams < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("max_concurrent_streams must be >= 1, got ", max_concurrent_streams));
  }
  if (!health_listen_address.empty()) {
    TV_RETURN_IF_ERROR(ParseHostPort(health_listen_address).status());
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<GrpcServer>> GrpcServer::Start(
    const ServerOptions& options, const std::vector<grpc::Service*>& services) {
  TV_RETURN_IF_ERROR(options.Validate());
  TV_ASSIGN_OR_RETURN(HostPort listen, ParseHostPort(options.listen_address));
  // Both are process-wide switches read when a builder is created.
  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();

  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort(options.listen_address, grpc::InsecureServerCredentials(), &port);
  builder.SetMaxReceiveMessageSize(static_cast<int>(options.max_message_bytes));
  builder.SetMaxSendMessageSize(static_cast<int>(options.max_message_bytes));
  builder.AddChannelArgument(GRPC_ARG_MAX_CONCURRENT_STREAMS, options.max_concurrent_streams);
  // gRPC sets SO_REUSEPORT by default, which lets a second server bind a port in use and
  // silently share its traffic. A port must belong to one process.
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  for (grpc::Service* service : services) builder.RegisterService(service);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (server == nullptr || port == 0) {
    return absl::UnavailableError(absl::StrCat("could not listen on ", options.listen_address,
                                               " (is the port in use, or the host not local?)"));
  }
  auto result = std::unique_ptr<GrpcServer>(
      new GrpcServer(options, std::move(server), port, JoinHostPort(listen.host, port)));
  if (!options.health_listen_address.empty()) {
    TV_ASSIGN_OR_RETURN(HostPort health_listen, ParseHostPort(options.health_listen_address));
    grpc::ServerBuilder health_builder;
    int health_port = 0;
    health_builder.AddListeningPort(options.health_listen_address,
                                    grpc::InsecureServerCredentials(), &health_port);
    health_builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
    result->health_server_ = health_builder.BuildAndStart();
    if (result->health_server_ == nullptr || health_port == 0) {
      return absl::UnavailableError(
          absl::StrCat("could not listen on ", options.health_listen_address, " (health port)"));
    }
    result->health_address_ = JoinHostPort(health_listen.host, health_port);
  }
  result->SetServing(false);
  for (grpc::HealthCheckServiceInterface* health : result->HealthServices()) {
    health->SetServingStatus(kLivenessService, true);
  }
  return result;
}

GrpcServer::GrpcServer(ServerOptions options, std::unique_ptr<grpc::Server> server, int port,
                       std::string address)
    : options_(std::move(options)),
      server_(std::move(server)),
      port_(port),
      address_(std::move(address)) {}

GrpcServer::~GrpcServer() { Shutdown(absl::ZeroDuration()); }

std::vector<grpc::HealthCheckServiceInterface*> GrpcServer::HealthServices() {
  std::vector<grpc::HealthCheckServiceInterface*> services;
  for (grpc::Server* server : {server_.get(), health_server_.get()}) {
    if (server != nullptr && server->GetHealthCheckService() != nullptr) {
      services.push_back(server->GetHealthCheckService());
    }
  }
  return services;
}

void GrpcServer::SetServing(bool serving) {
  for (grpc::HealthCheckServiceInterface* health : HealthServices()) {
    health->SetServingStatus("", serving);
    for (const std::string& name : options_.health_services) {
      health->SetServingStatus(name, serving);
    }
  }
}

void GrpcServer::Shutdown(absl::Duration grace) {
  if (shut_down_) return;
  shut_down_ = true;
  SetServing(false);
  for (grpc::HealthCheckServiceInterface* health : HealthServices()) {
    health->SetServingStatus(kLivenessService, false);
  }
  server_->Shutdown(absl::ToChronoTime(absl::Now() + grace));
  server_->Wait();
  if (health_server_ != nullptr) {
    health_server_->Shutdown(absl::ToChronoTime(absl::Now()));
    health_server_->Wait();
  }
}

}  // namespace treeverify::services
