// The health-only port Kubernetes' gRPC probes use: readiness follows the server's services,
// liveness (kLivenessService) is SERVING for as long as the process runs, on both ports.
#include "treeverify/services/server_bootstrap.h"

#include <memory>
#include <string>

#include "gtest/gtest.h"
#include "treeverify/services/verifier_client.h"

namespace treeverify::services {
namespace {

bool Serving(VerifierClient& client, const std::string& service) {
  absl::StatusOr<bool> serving = client.CheckHealth(service);
  EXPECT_TRUE(serving.ok()) << service << ": " << serving.status();
  return serving.ok() && *serving;
}

TEST(ServerBootstrapTest, TheHealthPortReportsReadinessAndLiveness) {
  absl::StatusOr<std::unique_ptr<GrpcServer>> server =
      GrpcServer::Start({.listen_address = "127.0.0.1:0",
                         .health_services = {"treeverify.v1.Verifier"},
                         .health_listen_address = "127.0.0.1:0"},
                        {});
  ASSERT_TRUE(server.ok()) << server.status();
  ASSERT_FALSE((*server)->health_address().empty());
  EXPECT_NE((*server)->health_address(), (*server)->address());
  auto health = VerifierClient::Connect((*server)->health_address(), absl::Seconds(10));
  ASSERT_TRUE(health.ok()) << health.status();
  auto main_port = VerifierClient::Connect((*server)->address(), absl::Seconds(10));
  ASSERT_TRUE(main_port.ok()) << main_port.status();
  // Not ready yet (the ranks have not joined), but alive.
  for (VerifierClient* client : {health->get(), main_port->get()}) {
    EXPECT_FALSE(Serving(*client, ""));
    EXPECT_FALSE(Serving(*client, "treeverify.v1.Verifier"));
    EXPECT_TRUE(Serving(*client, kLivenessService));
  }
  (*server)->SetServing(true);
  EXPECT_TRUE(Serving(**health, "treeverify.v1.Verifier"));
  EXPECT_TRUE(Serving(**health, ""));
  // A lost rank: not ready, still alive (Kubernetes must not restart the process for it).
  (*server)->SetServing(false);
  EXPECT_FALSE(Serving(**health, "treeverify.v1.Verifier"));
  EXPECT_TRUE(Serving(**health, kLivenessService));
  (*server)->Shutdown(absl::ZeroDuration());
  EXPECT_FALSE((*health)->CheckHealth(kLivenessService).ok()) << "nobody answers after shutdown";
}

TEST(ServerBootstrapTest, ABadHealthAddressIsAnInvalidArgument) {
  absl::StatusOr<std::unique_ptr<GrpcServer>> server =
      GrpcServer::Start({.listen_address = "127.0.0.1:0", .health_listen_address = "no-port"}, {});
  EXPECT_EQ(server.status().code(), absl::StatusCode::kInvalidArgument) << server.status();
}

}  // namespace
}  // namespace treeverify::services
