// The MoE expert projections at verify sizes on sm_90 and later: the active experts' weights
// stream through shared memory by bulk copies, once per group of up to 32 of their tokens, into
// mma.sync m16n8k16 (bf16 in, fp32 accumulate).
//
// A verify step reads each active expert's weights and does almost nothing else, so the kernel is
// a copy pipeline whose cost is the SM instructions it spends per byte (bench/NOTES.md, steps
// 89-90) and the DRAM's rate for the bytes it asks for (step 117). One producer warp walks the
// block's stages: per stage its lane 0 issues the weight tile (128 rows x 64 columns; for gate/up
// two tiles, 64 rows of gate and the same 64 rows of up) and the warp gathers the group's token
// rows with cp.async; both land on the stage's `full` mbarrier, beside a ticket that tells the
// consumers what the stage is. Eight consumer warps each own 16 of the stage's rows across its 64
// columns (four k-steps), so a warp's sums are complete at the last stage of an item's group:
// there is no cross-warp reduction, and the consumers never walk. Slots return to the producer
// through `empty` mbarriers, one arrival per consumer thread.
//
// Gate/up: a consumer's 16-row tile is 8 rows of gate (fragment rows 0-7) over the same 8 rows of
// up (rows 8-15), so a thread holds gate and up of one row and token: silu(gate) * up in
// registers.
//
// Work items: (active expert, row tile, block part) in that order, claimed one at a time by the
// blocks (ExpertWalk). Block parts (ReductionParts) split a long reduction across
// blocks, each writing its sums (gate/up: to w.gate_up_parts for FinishGateUp; down: to its part
// of w.expert_out for the combine), so that few active experts still fill the machine. An expert
// with more than 32 pairs streams its tile once per group of 32.
//
// The weights come packed as the stage holds them, an item's stages one after another, so a stage
// is one bulk copy and an item one run of memory; the stage format (the kernel's parameter) says
// how they are stored and how a consumer makes its A fragments of them:
// - Bf16Stage (treeverify/kernels/cuda/moe_tiles.h): 16 KB a stage (a down tile, or a gate tile
//   and the same tile of up), already in the 128-byte swizzle, read by ldmatrix.
// - Int4Stage (treeverify/kernels/cuda/moe_int4_tiles.h): four records a stage, each 4 KB of
//   nibbles and 512 bytes of group scales, each thread's fragments of a record one 16-byte load,
//   dequantized in registers to the bf16 a loader would have rounded them to: W4A16 with the bf16
//   stream's products at 28 % of its bytes.
// - Fp8Stage (moe_fp8_tiles.h): two records a stage, each 8 KB of e4m3 and its blocks' fp32
//   scales, each thread's fragments of a record two 16-byte loads, dequantized likewise: W8A16 with
//   the bf16 stream's products at half its bytes.
// Rows past an expert's and columns past the reduction's end are zeros in the stages; the token
// rows' columns past it are cp.async's zero fill.
#pragma once

#include <cuda.h>
#include <cuda_bf16.h>

#include <cstdint>

#include "element_convert.cuh"
#include "grid_dependency.cuh"
#include "mma_sync_primitives.cuh"
#include "moe_dequantize.cuh"
#include "moe_workspace.cuh"
#include "silu_times_up.cuh"
#include "sm90_primitives.cuh"
#include "treeverify/kernels/cuda/moe_fp8_tiles.h"
#include "treeverify/kernels/cuda/moe_int4_tiles.h"
#include "treeverify/kernels/cuda/moe_tiles.h"
#include "treeverify/kernels/moe.h"

namespace treeverify::kernels::cuda::moe {

inline constexpr int kTmaConsumerWarps = 8;
inline constexpr int kTmaThreads = (kTmaConsumerWarps + 1) * 32;  // + the producer warp
inline constexpr int kTmaRows = 16 * kTmaConsumerWarps;           // weight rows per stage
// Reduction columns per record: one 128-byte swizzled row of bf16 tokens. A stage is one record
// of bf16 weights, or several quantized ones (four INT4, two FP8).
inline constexpr int kTmaCols = 64;
inline constexpr int kTmaTokens = 32;  // token rows per group: four mma passes of 8
inline constexpr int kTmaPasses = kTmaTokens / 8;
inline constexpr int kTmaTokenBytes = kTmaTokens * kTmaCols * 2;  // a record's token rows
// ReductionParts counts the items and stages so.
static_assert(kTmaRows / 2 == kGateUpTileRows && kTmaRows == kDownTileRows);
static_assert(kTmaCols == kStageColumns);

// A stage format says how many records (kTmaCols columns of kTmaRows rows each) a stage holds,
// their bytes, and how a consumer makes its A fragments of one. A slot holds the stage's records
// (kWeightBytes, one bulk copy: an item's records are consecutive in memory), then each record's
// token rows (kTmaTokenBytes each) from kTokenOffset. Slots start at multiples of 1024 bytes, and
// so do the token rows, so that each 8-row period of the 128-byte swizzle covers the 32 banks once
// (ldmatrix without conflicts); the swizzle is relative to its 1024 bytes.

// bf16 tiles (moe_tiles.h): one 16 KB tile a stage.
template <bool kIsGateUp>
struct Bf16Stage {
  static constexpr bool kGateUp = kIsGateUp;
  static constexpr int kRecords = 1;
  static constexpr int kRecordBytes = kTmaRows * kTmaCols * 2;  // 16 KB
  static constexpr int kColumns = kRecords * kTmaCols;
  static constexpr int kWeightBytes = kRecords * kRecordBytes;
  static constexpr int kTokenOffset = kWeightBytes;
  static constexpr int kBytes = kTokenOffset + kRecords * kTmaTokenBytes;
  static constexpr int kMaxSlots = 8;
  static_assert(GateUpTileLayout(0, 0).tile_rows == kTmaRows / 2 &&
                DownTileLayout(0, 0).tile_rows == kTmaRows && MoeTileLayout::kColumns == kTmaCols);

  __device__ explicit Bf16Stage(const MoeExpertsParamsOf<Bf16, Bf16>& p)
      : base_(kGateUp ? p.packed_gate : p.packed_down),
        layout_(kGateUp ? GateUpTileLayout(p.intermediate, p.hidden)
                        : DownTileLayout(p.hidden, p.intermediate)) {}
  // Where the record (row tile, chunk of kTmaCols columns) of `expert` is; gate/up: the gate tile
  // and, right after it, the same tile of up.
  __device__ const void* Source(int32_t expert, int32_t tile, int32_t chunk) const {
    return base_ + layout_.TileOffset(expert, tile, chunk);
  }

  // A consumer warp's A fragments of a record: its 16 fragment rows (gate/up: 8 of gate over the
  // same 8 of up) at lane l's ldmatrix address.
  class Fragments {
   public:
    __device__ Fragments(const uint8_t* weights, int warp, int lane)
        : weights_(weights),
          row_(kGateUp ? 8 * warp + lane % 8 + (lane / 8 % 2) * (kTmaRows / 2)
                       : 16 * warp + lane % 8 + (lane / 8 % 2) * 8) {}
    // k-steps 2j and 2j + 1, from units 4j + l / 16 (two steps of two units).
    __device__ void Get(int j, int lane, uint32_t (&a)[2][4]) const {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        mma::LoadMatrices4(a[h],
                           weights_ + sm90::Swizzle128(row_, 8 * (4 * j + 2 * h + lane / 16)));
      }
    }

   private:
    const uint8_t* weights_;
    int row_;
  };

 private:
  const Bf16* base_;
  MoeTileLayout layout_;
};

// What the quantized stage formats share: kStageRecords records a stage of one format's
// (kInt4: INT4, else FP8), read from MoeExperts' params.
template <bool kIsGateUp, bool kInt4, int kStageRecords>
struct RecordStage {
  static constexpr bool kGateUp = kIsGateUp;
  static constexpr int kRecords = kStageRecords;
  static constexpr int kRecordBytes =
      kInt4 ? MoeInt4Records::kRecordBytes : MoeFp8Records::kRecordBytes;
  static constexpr int kColumns = kRecords * kTmaCols;
  static constexpr int kWeightBytes = kRecords * kRecordBytes;
  static constexpr int kTokenOffset = (kWeightBytes + 1023) / 1024 * 1024;
  static constexpr int kBytes = kTokenOffset + kRecords * kTmaTokenBytes;
  static constexpr int kMaxSlots = 8;
  static_assert(MoeRecordLayout::kRows == kTmaRows && MoeRecordLayout::kColumns == kTmaCols &&
                kRecordBytes % 16 == 0);

  __device__ explicit RecordStage(const MoeExpertsParamsOf<Bf16, Bf16>& p)
      : records_(RecordsOf(p, kInt4, kGateUp)) {}
  __device__ const void* Source(int32_t expert, int32_t tile, int32_t chunk) const {
    return records_.Record(expert, tile, chunk);
  }

 private:
  ExpertRecords records_;
};

// INT4 experts (moe_int4_tiles.h): four 4.5 KB records a stage, 18 KB, about the bf16 stage's
// bytes. A stage's fixed costs (its barriers, ticket and token copies, the walk) then weigh on as
// many bytes as a bf16 stage's; with one record a stage they were paid per 4.5 KB, and the stream
// ran at a quarter of the DRAM's rate (bench/NOTES.md, step 137).
template <bool kIsGateUp>
struct Int4Stage : RecordStage<kIsGateUp, true, 4> {
  using RecordStage<kIsGateUp, true, 4>::RecordStage;

  // A thread's words (k-steps 0-3) and scales (groups 0 and 1) of a record, loaded once; the
  // fragments are made from them in registers.
  class Fragments {
   public:
    __device__ Fragments(const uint8_t* weights, int warp, int lane)
        : words_(*reinterpret_cast<const uint4*>(weights + (warp * 32 + lane) * 16)),
          scales_(*reinterpret_cast<const uint2*>(weights + MoeInt4Records::kWordBytes +
                                                  (warp * 8 + lane / 4) * 8)) {}
    // k-steps 2j and 2j + 1: group j of the record.
    __device__ void Get(int j, int /*lane*/, uint32_t (&a)[2][4]) const {
      const uint32_t scales = j == 0 ? scales_.x : scales_.y;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const uint32_t word =
            j == 0 ? (h == 0 ? words_.x : words_.y) : (h == 0 ? words_.z : words_.w);
        DequantizeInt4Word(word, scales, a[h]);
      }
    }

   private:
    uint4 words_;
    uint2 scales_;
  };
};

// FP8 experts (moe_fp8_tiles.h): two 8 KB records a stage, 16 KB, the bf16 stage's bytes.
template <bool kIsGateUp>
struct Fp8Stage : RecordStage<kIsGateUp, false, 2> {
  using RecordStage<kIsGateUp, false, 2>::RecordStage;
  using RecordStage<kIsGateUp, false, 2>::kGateUp;  // for Fragments (a dependent base's member)

  // A thread's bytes of a record (k-steps 0-1, then 2-3) and its rows' scales (gate/up: fragment
  // rows g of gate, g + 8 of up; down: one block), loaded once.
  class Fragments {
   public:
    __device__ Fragments(const uint8_t* weights, int warp, int lane)
        : low_(*reinterpret_cast<const uint4*>(weights + ((warp * 2) * 32 + lane) * 16)),
          high_(*reinterpret_cast<const uint4*>(weights + ((warp * 2 + 1) * 32 + lane) * 16)) {
      const float* scales = reinterpret_cast<const float*>(weights + MoeFp8Records::kWeightBytes);
      row_g_ = scales[0];
      row_g8_ = kGateUp ? scales[1] : row_g_;
    }
    // k-steps 2j and 2j + 1.
    __device__ void Get(int j, int /*lane*/, uint32_t (&a)[2][4]) const {
      const uint4& bytes = j == 0 ? low_ : high_;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        DequantizeFp8Word(h == 0 ? bytes.x : bytes.z, h == 0 ? bytes.y : bytes.w, row_g_, row_g8_,
                          a[h]);
      }
    }

   private:
    uint4 low_, high_;
    float row_g_ = 0.0f, row_g8_ = 0.0f;
  };
};

// What a stage holds, from the producer to the consumers (16 bytes beside each slot).
struct StageTicket {
  int32_t row0;         // the item's first row (of gate/up's intermediate or down's hidden)
  int32_t group_begin;  // the group's first grouped pair
  int32_t k0;           // the stage's first reduction column
  int32_t bits;         // the group's tokens (0 past the block's last stage) | kFirst | kLast |
                        // (records - 1) << 12 | part << 16

  __device__ int32_t Count() const { return bits & 0xff; }
  __device__ bool First() const { return (bits & kFirst) != 0; }
  __device__ bool Last() const { return (bits & kLast) != 0; }
  __device__ int32_t Records() const { return (bits >> 12 & 0xf) + 1; }
  __device__ int32_t Part() const { return bits >> 16; }
  static constexpr int32_t kFirst = 0x100;  // the first stage of an item's group: sums from zero
  static constexpr int32_t kLast = 0x200;   // its last: the sums are stored
  static __device__ int32_t RecordBits(int32_t records) { return (records - 1) << 12; }
};
static_assert(kTmaTokens <= 0xff);

// A position in the ring of slots: the slot and the parity of its mbarriers' current phase, moved
// on one stage at a time. (Dividing the stage number by the runtime slot count cost ~40
// instructions a division, two a stage on the producer's dependent chain and one on each
// consumer's: bench/NOTES.md, step 127.)
struct RingPosition {
  int32_t slot = 0;
  uint32_t parity = 0;
  __device__ void Advance(int32_t stages) {
    if (++slot == stages) {
      slot = 0;
      parity ^= 1;
    }
  }
};

// Dynamic shared memory for `stages` slots of `Stage`: the slots (1024-aligned), then the
// mbarriers and the tickets; 1024 bytes of slack for the alignment.
template <class Stage>
__host__ __device__ constexpr int TmaSmemBytes(int stages) {
  static_assert(Stage::kBytes % 1024 == 0 && Stage::kTokenOffset % 1024 == 0);
  return 1024 + stages * (Stage::kBytes + 2 * 8 + int{sizeof(StageTicket)});
}

// The walk over a block's stages: its items, their token groups, and the stages (`columns` each,
// a multiple of kTmaCols) of each group's reduction range. Only the producer warp walks (all its
// lanes, in step). Blocks claim items one at a time from a counter the grouping zeroed (`claims`),
// so a block that streams faster takes more of them and the stream ends within about one item on
// every block (with a fixed share of 3 or 4 items each, the first blocks were done 29 of gate/up's
// 64 us before the last; the 64-node step took 27 % less with claims: bench/NOTES.md, step 101).
// Each item's sums are one block's, in stage order, whichever block that is: the bytes do not
// depend on the scheduling.
struct ExpertWalk {
  int32_t columns, rows_total, length, chunks, per_part, tiles, parts, rows_per_tile, items;
  // The current stage: item (active expert, row tile, block part), group and the reduction
  // columns [k0, k0 + columns) of [k_begin, k_end).
  int32_t active = -1, expert = 0, tile = 0, part = 0;
  int32_t row0 = 0, k_begin = 0, k_end = 0, k0 = 0;
  int32_t pairs_begin = 0, pairs_end = 0, group_begin = 0, group_end = 0;

  // Rows of one item: 64 of gate with the same 64 of up, or 128 of down.
  __host__ __device__ static constexpr int RowsPerTile(bool is_gate_up) {
    return is_gate_up ? kTmaRows / 2 : kTmaRows;
  }

  __device__ ExpertWalk(const MoeExpertsParamsOf<Bf16, Bf16>& p, const Workspace& w,
                        int32_t block_parts, bool is_gate_up, int32_t stage_columns,
                        int32_t* claims)
      : columns(stage_columns),
        rows_total(static_cast<int32_t>(is_gate_up ? p.intermediate : p.hidden)),
        length(static_cast<int32_t>(is_gate_up ? p.hidden : p.intermediate)),
        chunks((length + columns - 1) / columns),
        per_part((chunks + block_parts - 1) / block_parts),
        tiles((rows_total + RowsPerTile(is_gate_up) - 1) / RowsPerTile(is_gate_up)),
        parts(block_parts),
        rows_per_tile(RowsPerTile(is_gate_up)),
        // Fewer than 2^30 items (MoeExperts checks the most there can be).
        items(*w.num_active * tiles * block_parts),
        claims_(claims),
        claimed_(static_cast<int32_t>(blockIdx.x)) {}

  __device__ bool FirstOfGroup() const { return k0 == k_begin; }
  __device__ bool LastOfGroup() const { return k0 + columns >= k_end; }
  // The stage's records: kTmaCols-column pieces of [k0, k_end), at most columns / kTmaCols.
  __device__ int32_t Records() const {
    return (min(columns, k_end - k0) + kTmaCols - 1) / kTmaCols;
  }

  // Advances to the next stage; false past the block's last, and from then on.
  __device__ bool Next(const Workspace& w) {
    if (done_) return false;
    // The item claimed at the current one's start is resolved at its second stage, so that its
    // loads are in flight while this item streams, not waited for at its boundary.
    if (started_ && !next_resolved_) Resolve(w);
    if (started_ && k0 + columns < k_end) {
      k0 += columns;
      return true;
    }
    if (started_ && group_end < pairs_end) {
      group_begin = group_end;
      group_end = min(pairs_end, group_begin + kTmaTokens);
      k0 = k_begin;
      return true;
    }
    // The next item: the one claimed ahead, while the one after is claimed; an item of an empty
    // part range (more parts than chunks) has no stages. Claims stay below 2^31: fewer than 2^30
    // items (MoeExperts checks, and the grid is no larger), each block claims once past the last.
    do {
      if (!next_resolved_) Resolve(w);
      const int32_t item = next_item_;
      if (item >= items) {
        done_ = true;  // k_end may hold a skipped item's: the branches above must not see it
        return false;
      }
      started_ = true;
      next_resolved_ = false;
      Claim();
      const int32_t per_expert = tiles * parts;
      active = item / per_expert;
      tile = item % per_expert / parts;
      part = item % parts;
      expert = next_expert_;
      pairs_begin = next_pairs_.x;
      pairs_end = next_pairs_.y;
      k_begin = min(chunks, part * per_part) * columns;
      k_end = min(length, min(chunks, (part + 1) * per_part) * columns);
    } while (k_begin >= k_end);
    row0 = tile * rows_per_tile;
    group_begin = pairs_begin;
    group_end = min(pairs_end, group_begin + kTmaTokens);
    k0 = k_begin;
    return true;
  }

 private:
  // Lane 0 claims the next item; the value is read (and waited for) only when it is needed. Block
  // b's first item is item b, so that no block waits for a claim before its first copy; the
  // counter hands out the rest.
  __device__ void Claim() {
    if (threadIdx.x % 32 == 0) claimed_ = atomicAdd(claims_, 1) + static_cast<int32_t>(gridDim.x);
  }

  // The claimed item (every lane), its expert and the expert's grouped pairs; their loads are
  // waited for where they are used, at the next item's start.
  __device__ void Resolve(const Workspace& w) {
    next_item_ = __shfl_sync(0xffffffffu, claimed_, 0);
    if (next_item_ < items) {
      const int32_t next_active = next_item_ / (tiles * parts);
      next_expert_ = w.active[next_active];
      next_pairs_ = w.active_pairs[next_active];
    }
    next_resolved_ = true;
  }

  int32_t* claims_;
  int32_t claimed_;  // lane 0's claim (every lane's, for the first item), not yet walked
  int32_t next_item_ = 0, next_expert_ = 0;
  int2 next_pairs_ = {};
  bool next_resolved_ = false;
  bool started_ = false;
  bool done_ = false;
};

// Gate/up (Stage::kGateUp: out silu(gate) * up, or the block part's sums) or down (out: fp32 per
// entry) for every active expert, from the stages of `Stage` (Bf16Stage: p.packed_gate with
// packed_up, or p.packed_down; Int4Stage: p.int4_gate_up or p.int4_down; Fp8Stage: p.fp8_*),
// through `stages` slots.
template <class Stage>
__global__ void __launch_bounds__(kTmaThreads, 2)
    ExpertTmaKernel(MoeExpertsParamsOf<Bf16, Bf16> p, Workspace w, int32_t block_parts,
                    int32_t stages) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  constexpr bool kGateUp = Stage::kGateUp;
  extern __shared__ __align__(128) uint8_t smem_raw[];
  uint8_t* slots = sm90::AlignSharedUp<1024>(smem_raw);
  uint64_t* full = reinterpret_cast<uint64_t*>(slots + stages * Stage::kBytes);
  uint64_t* empty = full + stages;
  StageTicket* tickets = reinterpret_cast<StageTicket*>(empty + stages);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (threadIdx.x == 0) {
    for (int s = 0; s < stages; ++s) {
      sm90::MbarrierInit(&full[s], 1 + 32);  // lane 0's expect_tx and the warp's cp.async arrivals
      sm90::MbarrierInit(&empty[s], kTmaConsumerWarps * 32);
    }
    sm90::FenceBarrierInit();
  }
  __syncthreads();
  // The barriers above were set up while the predecessor (the grouping, or the gate/up
  // reduction) finished; everything below reads its outputs or follows them, except down's first
  // weight tiles: the weights do not depend on the step, and the walk reads only the grouping's
  // lists, complete before down could launch (each kernel of the chain waits before it allows its
  // dependent, and FinishGateUp comes between: programmatic_launch.h). So down's producer issues
  // its first slots' tiles before it waits; they stream during the gate/up stream's tail and
  // FinishGateUp, where down's blocks become resident as gate/up's leave.
  constexpr bool kIssueBeforeWait = !kGateUp;
  const bool producer = warp == kTmaConsumerWarps;
  if (!(kIssueBeforeWait && producer)) WaitForPredecessorGrid();
  AllowDependentGridLaunch();

  if (producer) {
    // The producer. Token rows: lane l copies 16-byte unit l % 8 of rows l / 8 + 4 * turn.
    const Stage weight_source(p);
    // A stage's ticket and weight tiles, once its slot is free (lane 0; the full barrier then
    // waits for the token rows' 32 arrivals).
    auto issue_weights = [&](const RingPosition& ring, bool more, const ExpertWalk& at) {
      const int32_t slot = ring.slot;
      sm90::MbarrierWait(&empty[slot], ring.parity ^ 1);
      if (lane != 0) return;
      const int32_t count = more ? at.group_end - at.group_begin : 0;
      const int32_t records = more ? at.Records() : 1;
      const int32_t bits = count | (at.FirstOfGroup() ? StageTicket::kFirst : 0) |
                           (at.LastOfGroup() ? StageTicket::kLast : 0) |
                           StageTicket::RecordBits(records) | at.part << 16;
      tickets[slot] = StageTicket{at.row0, at.group_begin, at.k0, bits};
      const int32_t bytes = records * Stage::kRecordBytes;
      sm90::MbarrierArriveExpectTx(&full[slot], more ? bytes : 0);
      if (more) {
        sm90::BulkLoad(slots + slot * Stage::kBytes,
                       weight_source.Source(at.expert, at.tile, at.k0 / kTmaCols), bytes,
                       &full[slot]);
      }
    };
    // A stage's token rows, from its ticket, then the warp's arrivals on its full barrier. Lane l
    // copies unit l % 8 of rows l / 8 + 4 * turn; in the slot's swizzle those sit at turn * 512
    // bytes plus one of two lane offsets, by the turn's parity (the swizzle's row & 7), computed
    // once. Rows past the group's count are not copied (nor read).
    constexpr int kTokenTurns = kTmaTokens * 8 / 32;
    const uint32_t token_unit_even = sm90::Swizzle128(lane / 8, 8 * (lane % 8));
    const uint32_t token_unit_odd = token_unit_even ^ (4 << 4);  // the unit's bit 2 flipped
    const Bf16* token_rows[kTokenTurns] = {};
    int32_t token_turns = 0;  // this lane's rows of the group
    int32_t token_group = -1;
    auto issue_tokens = [&](const RingPosition& ring, int32_t length) {
      const int32_t slot = ring.slot;
      const StageTicket ticket = tickets[slot];
      if (ticket.group_begin != token_group) {
        token_group = ticket.group_begin;
        token_turns = max(0, (ticket.Count() - lane / 8 + 3) / 4);
#pragma unroll
        for (int turn = 0; turn < kTokenTurns; ++turn) {
          const int32_t pair = ticket.group_begin + lane / 8 + 4 * turn;
          if (turn < token_turns) {
            token_rows[turn] = kGateUp ? p.x + int64_t{w.pair_token[pair]} * p.hidden
                                       : w.activated + int64_t{pair} * p.intermediate;
          }
        }
      }
      if (ticket.Count() > 0) {
        uint8_t* tokens = slots + slot * Stage::kBytes + Stage::kTokenOffset;
#pragma unroll
        for (int record = 0; record < Stage::kRecords; ++record) {
          if (record >= ticket.Records()) break;
          const int32_t column = ticket.k0 + record * kTmaCols + 8 * (lane % 8);
          const bool in_range = column < length;
          uint8_t* record_tokens = tokens + record * kTmaTokenBytes;
#pragma unroll
          for (int turn = 0; turn < kTokenTurns; ++turn) {
            if (turn < token_turns) {
              mma::CpAsync16(
                  record_tokens + turn * 512 + (turn % 2 == 0 ? token_unit_even : token_unit_odd),
                  token_rows[turn] + column, in_range);
            }
          }
        }
      }
      mma::CpAsyncArriveOn(&full[slot]);
    };
    ExpertWalk walk(p, w, block_parts, kGateUp, Stage::kColumns, w.claims + (kGateUp ? 0 : 1));
    // Down's token rows wait for the predecessor grid, its first `stages` weight tiles do not.
    bool waited = !kIssueBeforeWait;
    int32_t tokens_issued = 0;  // stages whose token rows are out
    RingPosition weights_at, tokens_at;
    for (int32_t stage = 0;; ++stage) {
      const bool more = walk.Next(w);
      issue_weights(weights_at, more, walk);
      weights_at.Advance(stages);
      __syncwarp();  // lane 0's ticket, for every lane
      if (!waited && (!more || stage + 1 == stages)) {
        WaitForPredecessorGrid();
        waited = true;
      }
      for (; waited && tokens_issued <= stage; ++tokens_issued) {
        issue_tokens(tokens_at, walk.length);
        tokens_at.Advance(stages);
      }
      if (!more) return;
    }
  }

  // A consumer: this warp's 16 fragment rows (gate/up: 8 of gate over the same 8 of up) of each
  // stage, and the tokens' (row l % 8 of the pass).
  const int g = lane / 4, q = lane % 4;
  float acc[kTmaPasses][4] = {};
  // Down: the entries (token * top_k + slot) of this thread's pairs, loaded at the group's first
  // stage so that the stores at its last do not wait for them.
  int32_t entries[kTmaPasses][2] = {};
  for (RingPosition at;; at.Advance(stages)) {
    const int32_t slot = at.slot;
    sm90::MbarrierWait(&full[slot], at.parity);
    const StageTicket ticket = tickets[slot];
    if (ticket.Count() == 0) return;
    if (ticket.First()) {
#pragma unroll
      for (int pass = 0; pass < kTmaPasses; ++pass) {
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[pass][i] = 0.0f;
        if constexpr (!kGateUp) {
#pragma unroll
          for (int i = 0; i < 2; ++i) {
            const int token = 8 * pass + 2 * q + i;
            entries[pass][i] =
                token < ticket.Count() ? w.pair_entry[ticket.group_begin + token] : 0;
          }
        }
      }
    }
    const uint8_t* weights = slots + slot * Stage::kBytes;
    const uint8_t* tokens = weights + Stage::kTokenOffset;
#pragma unroll
    for (int record = 0; record < Stage::kRecords; ++record) {
      if (record >= ticket.Records()) break;
      const typename Stage::Fragments fragments(weights + record * Stage::kRecordBytes, warp, lane);
      const uint8_t* record_tokens = tokens + record * kTmaTokenBytes;
      // k-steps 2j and 2j + 1: A from the record's fragments, B from units 4j + l / 8 (b0, b1 of
      // step 2j, then of 2j + 1).
#pragma unroll
      for (int j = 0; j < kTmaCols / 32; ++j) {
        uint32_t a[2][4];
        fragments.Get(j, lane, a);
#pragma unroll
        for (int pass = 0; pass < kTmaPasses; ++pass) {
          if (8 * pass >= ticket.Count()) break;
          uint32_t b[4];
          mma::LoadMatrices4(
              b, record_tokens + sm90::Swizzle128(8 * pass + lane % 8, 8 * (4 * j + lane / 8)));
          mma::MmaBf16(acc[pass], a[0], b[0], b[1]);
          mma::MmaBf16(acc[pass], a[1], b[2], b[3]);
        }
      }
    }
    // Every consumer thread arrives once its own reads of the slot are done.
    sm90::MbarrierArrive(&empty[slot]);
    if (!ticket.Last()) continue;

      // The group's sums: accumulator i of pass `pass` is fragment row g (+ 8 for i >= 2), token
      // 8 * pass + 2q + (i & 1).
#pragma unroll
    for (int pass = 0; pass < kTmaPasses; ++pass) {
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const int token = 8 * pass + 2 * q + i;
        if (token >= ticket.Count()) continue;
        if constexpr (kGateUp) {
          const int32_t pair = ticket.group_begin + token;
          const int64_t row = ticket.row0 + 8 * warp + g;
          if (row >= p.intermediate) continue;
          const float gate = acc[pass][i], up = acc[pass][2 + i];
          if (block_parts > 1) {
            const int32_t part = ticket.Part();
            float* out =
                w.gate_up_parts + ((part * p.tokens * p.top_k + pair) * 2) * p.intermediate + row;
            out[0] = gate;
            out[p.intermediate] = up;
          } else {
            w.activated[int64_t{pair} * p.intermediate + row] =
                FromFloat<Bf16>(SiluTimesUp(gate, up));
          }
        } else {
          const int64_t row = ticket.row0 + 16 * warp + g;
          const int64_t part = ticket.Part();
          float* out = w.expert_out + (part * p.tokens * p.top_k + entries[pass][i]) * p.hidden;
          if (row < p.hidden) out[row] = acc[pass][i];
          if (row + 8 < p.hidden) out[row + 8] = acc[pass][2 + i];
        }
      }
    }
  }
#else
  __trap();  // launched only on sm_90 and later (MoeExperts checks the device)
#endif
}

// activated = silu(gate) * up from the blocks' partial sums, added in part order. A thread per
// (grouped pair, row); pairs past the step's count return. Every part's sums are loaded before
// the first add: one trip to the L2 instead of one per part (bench/NOTES.md, step 116).
__global__ void FinishGateUp(MoeExpertsParamsOf<Bf16, Bf16> p, Workspace w, int32_t block_parts) {
  // Allows the down stream to launch before this waits: down's blocks then take the gate/up
  // stream's places as they free and issue their first weight tiles (ExpertTmaKernel).
  AllowDependentGridLaunch();
  WaitForPredecessorGrid();
  const int64_t index = blockIdx.x * int64_t{blockDim.x} + threadIdx.x;
  const int64_t pair = index / p.intermediate, row = index % p.intermediate;
  if (pair >= w.offsets[p.num_local_experts]) return;
  const int64_t stride = p.tokens * p.top_k * 2 * p.intermediate;
  const float* sums = w.gate_up_parts + pair * 2 * p.intermediate + row;
  float gate[kMaxReductionParts], up[kMaxReductionParts];
#pragma unroll
  for (int32_t part = 0; part < kMaxReductionParts; ++part) {
    gate[part] = part < block_parts ? sums[part * stride] : 0.0f;
    up[part] = part < block_parts ? sums[part * stride + p.intermediate] : 0.0f;
  }
  float gate_sum = gate[0], up_sum = up[0];
#pragma unroll
  for (int32_t part = 1; part < kMaxReductionParts; ++part) {
    if (part < block_parts) {
      gate_sum = __fadd_rn(gate_sum, gate[part]);
      up_sum = __fadd_rn(up_sum, up[part]);
    }
  }
  w.activated[pair * p.intermediate + row] = FromFloat<Bf16>(SiluTimesUp(gate_sum, up_sum));
}

}  // namespace treeverify::kernels::cuda::moe
