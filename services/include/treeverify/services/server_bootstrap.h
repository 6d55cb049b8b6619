// Builds and starts a gRPC server for treeverify's services: the listening address (port 0
// picks a free port, reported back), message size and concurrent stream limits, the standard
// grpc.health.v1 service (NOT_SERVING until told otherwise) and server reflection. Optionally a
// second, plaintext port that serves only grpc.health.v1, for Kubernetes' gRPC probes: there the
// server's services report readiness, and kLivenessService reports SERVING for as long as the
// process runs (a replica that lost a rank is not ready, but restarting it would not help).
//
//   TV_ASSIGN_OR_RETURN(std::unique_ptr<GrpcServer> server,
//                       GrpcServer::Start({.listen_address = "127.0.0.1:0",
//                                          .health_services = {"treeverify.v1.Verifier"}},
//                                         {&rendezvous, &verifier}));
//   std::printf("listening on %s\n", server->address().c_str());
//   server->SetServing(true);
//   ...
//   server->Shutdown(absl::Seconds(10));
#pragma once

#include <grpcpp/grpcpp.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "treeverify/services/client_channel.h"

namespace treeverify::services {

struct HostPort {
  std::string host;  // without brackets, also for IPv6
  int port = 0;
};

// "host:port", "[v6]:port". INVALID_ARGUMENT for anything else or a port outside [0, 65535].
absl::StatusOr<HostPort> ParseHostPort(absl::string_view address);
// The inverse: brackets around an IPv6 host.
std::string JoinHostPort(absl::string_view host, int port);
// True for the addresses that listen on every interface ("0.0.0.0", "::", "").
bool IsWildcardHost(absl::string_view host);

struct ServerOptions {
  std::string listen_address = "127.0.0.1:0";
  int64_t max_message_bytes = kDefaultMaxMessageBytes;
  int max_concurrent_streams = 256;  // per client connection
  // Services the health service reports on, besides the whole server ("").
  std::vector<std::string> health_services;
  // host:port of the health-only port (port 0 picks one); empty: none.
  std::string health_listen_address;

  absl::Status Validate() const;
};

// SERVING from the start until Shutdown, on both ports: the liveness probe's service.
inline constexpr char kLivenessService[] = "treeverify.liveness";

class GrpcServer {
 public:
  // The services must outlive the server. UNAVAILABLE when the address cannot be bound.
  static absl::StatusOr<std::unique_ptr<GrpcServer>> Start(
      const ServerOptions& options, const std::vector<grpc::Service*>& services);
  // Shutdown(zero grace) unless it was called.
  ~GrpcServer();

  int port() const { return port_; }
  // The listening address with the bound port ("127.0.0.1:43121").
  const std::string& address() const { return address_; }
  // The health-only port's address; empty without one.
  const std::string& health_address() const { return health_address_; }

  // Health of the whole server and of every service in options.health_services.
  void SetServing(bool serving);

  // NOT_SERVING, then stops accepting calls and waits for the running ones up to `grace`;
  // after that they are cancelled. Returns once every call finished. Idempotent.
  void Shutdown(absl::Duration grace);

  grpc::Server& server() { return *server_; }

 private:
  GrpcServer(ServerOptions options, std::unique_ptr<grpc::Server> server, int port,
             std::string address);
  // Every server's health service: the main one's, and the health port's.
  std::vector<grpc::HealthCheckServiceInterface*> HealthServices();

  const ServerOptions options_;
  std::unique_ptr<grpc::Server> server_;
  const int port_;
  const std::string address_;
  std::unique_ptr<grpc::Server> health_server_;
  std::string health_address_;
  bool shut_down_ = false;
};

}  // namespace treeverify::services
