// Status propagation helpers shared by every treeverify library.
//
// Debian's Abseil (20220623) predates ABSL_RETURN_IF_ERROR, so we carry our own two macros:
//
//   TV_RETURN_IF_ERROR(cache.Append(seq, rows));
//   TV_ASSIGN_OR_RETURN(auto config, ModelConfig::FromJson(text));
#pragma once

#include "absl/status/status.h"
#include "absl/status/statusor.h"

#define TV_STATUS_CONCAT_INNER(a, b) a##b
#define TV_STATUS_CONCAT(a, b) TV_STATUS_CONCAT_INNER(a, b)

#define TV_RETURN_IF_ERROR(expr)             \
  do {                                       \
    ::absl::Status tv_status_ = (expr);      \
    if (!tv_status_.ok()) return tv_status_; \
  } while (0)

#define TV_ASSIGN_OR_RETURN_IMPL(tmp, lhs, expr) \
  auto tmp = (expr);                             \
  if (!tmp.ok()) return std::move(tmp).status(); \
  lhs = std::move(tmp).value()

#define TV_ASSIGN_OR_RETURN(lhs, expr) \
  TV_ASSIGN_OR_RETURN_IMPL(TV_STATUS_CONCAT(tv_statusor_, __LINE__), lhs, expr)
