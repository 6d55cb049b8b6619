#include "treeverify/monitoring/metrics_server.h"

#include <netdb.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <thread>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "prometheus/text_serializer.h"
#include "treeverify/monitoring/process_collector.h"

namespace treeverify::monitoring {
namespace {

// How often the serving thread looks at the stop flag while no scrape comes.
constexpr int kPollMilliseconds = 100;
// One connection at a time: a scrape gets this long in all to send its request and read the
// answer, so that a slow or stuck client can hold the server (and its shutdown) no longer.
constexpr int kConnectionSeconds = 5;
constexpr size_t kMaxRequestBytes = 16384;

void SendAll(int fd, const std::string& data, std::chrono::steady_clock::time_point deadline) {
  size_t sent = 0;
  while (sent < data.size() && std::chrono::steady_clock::now() < deadline) {
    const ssize_t n = send(fd, data.data() + sent, data.size() - sent, MSG_NOSIGNAL);
    if (n <= 0) return;  // the scraper went away
    sent += static_cast<size_t>(n);
  }
}

std::string Response(const char* status, const char* content_type, const std::string& body) {
  return absl::StrCat("HTTP/1.1 ", status, "\r\nContent-Type: ", content_type,
                      "\r\nContent-Length: ", body.size(), "\r\nConnection: close\r\n\r\n", body);
}

}  // namespace

absl::StatusOr<std::unique_ptr<MetricsServer>> MetricsServer::Start(
    const std::string& address, std::shared_ptr<prometheus::Registry> registry) {
  const size_t colon = address.rfind(':');
  if (colon == std::string::npos || colon + 1 == address.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("metrics address '", address, "' needs host:port (port 0 picks one)"));
  }
  std::string host = address.substr(0, colon);
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') {
    host = host.substr(1, host.size() - 2);  // [::1]:9100
  }
  const std::string port = address.substr(colon + 1);
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE;
  addrinfo* found = nullptr;
  if (const int error =
          getaddrinfo(host.empty() ? nullptr : host.c_str(), port.c_str(), &hints, &found);
      error != 0) {
    return absl::UnavailableError(
        absl::StrCat("cannot serve metrics on ", address, ": ", gai_strerror(error)));
  }
  std::unique_ptr<MetricsServer> server(new MetricsServer());
  server->listener_ = socket(found->ai_family, found->ai_socktype | SOCK_CLOEXEC, 0);
  const int reuse = 1;
  const bool bound =
      server->listener_ >= 0 &&
      setsockopt(server->listener_, SOL_SOCKET, SO_REUSEADDR, &reuse, sizeof(reuse)) == 0 &&
      bind(server->listener_, found->ai_addr, found->ai_addrlen) == 0 &&
      listen(server->listener_, 16) == 0;
  const int bind_errno = errno;
  freeaddrinfo(found);
  if (!bound) {
    return absl::UnavailableError(
        absl::StrCat("cannot serve metrics on ", address, ": ", std::strerror(bind_errno)));
  }
  sockaddr_storage local{};
  socklen_t length = sizeof(local);
  getsockname(server->listener_, reinterpret_cast<sockaddr*>(&local), &length);
  char bound_port[NI_MAXSERV] = {};
  getnameinfo(reinterpret_cast<sockaddr*>(&local), length, nullptr, 0, bound_port,
              sizeof(bound_port), NI_NUMERICSERV);
  server->address_ = absl::StrCat(address.substr(0, colon), ":", bound_port);
  server->registry_ = std::move(registry);
  server->process_ = std::make_shared<ProcessCollector>();
  server->thread_ = std::thread([s = server.get()] { s->Serve(); });
  return server;
}

MetricsServer::~MetricsServer() {
  stopping_ = true;
  if (thread_.joinable()) thread_.join();
  if (listener_ >= 0) close(listener_);
}

std::string MetricsServer::Scrape() const {
  std::vector<prometheus::MetricFamily> families = registry_->Collect();
  for (prometheus::MetricFamily& family : process_->Collect())
    families.push_back(std::move(family));
  return prometheus::TextSerializer().Serialize(families);
}

void MetricsServer::Serve() {
  while (!stopping_) {
    pollfd waiting{.fd = listener_, .events = POLLIN, .revents = 0};
    if (poll(&waiting, 1, kPollMilliseconds) <= 0) continue;
    const int connection = accept4(listener_, nullptr, nullptr, SOCK_CLOEXEC);
    if (connection < 0) {
      // Out of descriptors (or the like): the pending connection keeps poll() ready, so wait
      // rather than spin.
      std::this_thread::sleep_for(std::chrono::milliseconds(kPollMilliseconds));
      continue;
    }
    Answer(connection);
    close(connection);
  }
}

void MetricsServer::Answer(int connection) const {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(kConnectionSeconds);
  // Each recv() and send() waits at most a second, and the loops stop at the deadline or when
  // the server stops.
  timeval timeout{.tv_sec = 1, .tv_usec = 0};
  setsockopt(connection, SOL_SOCKET, SO_RCVTIMEO, &timeout, sizeof(timeout));
  setsockopt(connection, SOL_SOCKET, SO_SNDTIMEO, &timeout, sizeof(timeout));
  std::string request;
  char buffer[4096];
  while (request.find("\r\n\r\n") == std::string::npos && request.size() < kMaxRequestBytes) {
    if (stopping_ || std::chrono::steady_clock::now() >= deadline) return;
    const ssize_t n = recv(connection, buffer, sizeof(buffer), 0);
    if (n == 0 || (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)) return;
    if (n > 0) request.append(buffer, static_cast<size_t>(n));
  }
  // "GET /metrics HTTP/1.1" (a query string is ignored).
  const std::string line = request.substr(0, request.find("\r\n"));
  if (!absl::StartsWith(line, "GET ")) {
    SendAll(connection, Response("405 Method Not Allowed", "text/plain", "GET only\n"), deadline);
    return;
  }
  const std::string target = line.substr(4, line.find(' ', 4) - 4);
  if (target != "/metrics" && !absl::StartsWith(target, "/metrics?")) {
    SendAll(connection, Response("404 Not Found", "text/plain", "metrics are at /metrics\n"),
            deadline);
    return;
  }
  SendAll(connection, Response("200 OK", "text/plain; version=0.0.4; charset=utf-8", Scrape()),
          deadline);
}

}  // namespace treeverify::monitoring
