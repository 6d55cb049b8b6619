#include "treeverify/services/status_conversion.h"

#include <string>

#include "absl/strings/str_cat.h"

namespace treeverify::services {
namespace {

// google.rpc.Code: OK = 0 .. UNAUTHENTICATED = 16, the same numbers in both libraries.
constexpr int kMaxCanonicalCode = 16;

bool IsCanonical(int code) { return code >= 0 && code <= kMaxCanonicalCode; }

}  // namespace

grpc::Status ToGrpcStatus(const absl::Status& status) {
  if (status.ok()) return grpc::Status::OK;
  const int code = static_cast<int>(status.code());
  if (!IsCanonical(code)) {
    return grpc::Status(grpc::StatusCode::UNKNOWN, std::string(status.message()));
  }
  return grpc::Status(static_cast<grpc::StatusCode>(code), std::string(status.message()));
}

absl::Status ToAbslStatus(const grpc::Status& status) {
  if (status.ok()) return absl::OkStatus();
  const int code = static_cast<int>(status.error_code());
  if (!IsCanonical(code)) return absl::UnknownError(status.error_message());
  return absl::Status(static_cast<absl::StatusCode>(code), status.error_message());
}

absl::Status StatusFromCode(int32_t code, absl::string_view message) {
  if (code == 0) return absl::OkStatus();
  if (!IsCanonical(code)) {
    return absl::UnknownError(absl::StrCat("status code ", code, ": ", message));
  }
  return absl::Status(static_cast<absl::StatusCode>(code), message);
}

}  // namespace treeverify::services
