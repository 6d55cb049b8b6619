#include "treeverify/worker/kv_storage.h"

#include <cstdint>
#include <initializer_list>
#include <limits>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "treeverify/kernels/kv_cache_ops.h"
#include "treeverify/kernels/status.h"

namespace treeverify::worker {
namespace {

// The product of non-negative factors, or false when it does not fit in int64_t.
bool CheckedProduct(std::initializer_list<int64_t> factors, int64_t* product) {
  int64_t result = 1;
  for (int64_t factor : factors) {
    if (__builtin_mul_overflow(result, factor, &result)) return false;
  }
  *product = result;
  return true;
}

}  // namespace

absl::Status KvCacheOptions::Validate() const {
  // Page ids travel as int32 in page tables (and to the attention kernels).
  if (num_pages <= 0 || num_pages > std::numeric_limits<int32_t>::max()) {
    return absl::InvalidArgumentError(
        absl::StrCat("KvCacheOptions.num_pages must be in [1, 2147483647], got ", num_pages));
  }
  if (page_size < 1 || page_size > 4096) {
    return absl::InvalidArgumentError(
        absl::StrCat("KvCacheOptions.page_size must be in [1, 4096], got ", page_size));
  }
  if (num_layers <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("KvCacheOptions.num_layers must be positive, got ", num_layers));
  }
  if (row_dim <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("KvCacheOptions.row_dim must be positive, got ", row_dim));
  }
  int64_t total_floats = 0;
  if (!CheckedProduct({num_layers, num_pages, int64_t{page_size}, row_dim}, &total_floats) ||
      static_cast<uint64_t>(total_floats) > std::vector<float>().max_size()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "KvCacheOptions: num_layers x num_pages x page_size x row_dim (", num_layers, " x ",
        num_pages, " x ", page_size, " x ", row_dim, ") floats overflows the addressable size"));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<CpuKvStorage>> CpuKvStorage::Create(const KvCacheOptions& options) {
  TV_RETURN_IF_ERROR(options.Validate());
  return std::unique_ptr<CpuKvStorage>(new CpuKvStorage(options));
}

CpuKvStorage::CpuKvStorage(const KvCacheOptions& options)
    : options_(options),
      layer_elements_(options.num_slots() * options.row_dim),
      rows_(static_cast<size_t>(options.num_layers * layer_elements_), 0.0f) {}

absl::Status CheckRowMoves(absl::Span<const int64_t> src_slots, absl::Span<const int64_t> dst_slots,
                           int64_t num_slots) {
  if (src_slots.size() != dst_slots.size()) {
    return absl::InvalidArgumentError(absl::StrCat("MoveRows: ", src_slots.size(),
                                                   " source slots but ", dst_slots.size(),
                                                   " destination slots"));
  }
  for (size_t i = 0; i < src_slots.size(); ++i) {
    if (src_slots[i] < 0 || src_slots[i] >= num_slots || dst_slots[i] < 0 ||
        dst_slots[i] >= num_slots) {
      return absl::InvalidArgumentError(absl::StrCat("MoveRows: move ", i, " (", src_slots[i],
                                                     " -> ", dst_slots[i], ") leaves [0, ",
                                                     num_slots, ")"));
    }
  }
  return absl::OkStatus();
}

absl::Status CpuKvStorage::MoveRows(absl::Span<const int64_t> src_slots,
                                    absl::Span<const int64_t> dst_slots) {
  TV_RETURN_IF_ERROR(CheckRowMoves(src_slots, dst_slots, options_.num_slots()));
  for (int64_t layer = 0; !src_slots.empty() && layer < options_.num_layers; ++layer) {
    TV_RETURN_IF_ERROR(kernels::cpu::KvCopy({.src_slots = src_slots.data(),
                                             .dst_slots = dst_slots.data(),
                                             .cache = layer_data(layer),
                                             .count = static_cast<int64_t>(src_slots.size()),
                                             .row_dim = options_.row_dim,
                                             .num_slots = options_.num_slots()}));
  }
  return absl::OkStatus();
}

}  // namespace treeverify::worker
