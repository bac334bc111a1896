// Recomputation: trading compute for memory. A checkpoint segment keeps only its inputs for the
// backward; everything inside is recomputed right before the backward needs it (bit-identically:
// random ops reuse the Philox seed and counter of the original).
//
//   auto block = [&](const std::vector<kiln::Tensor>& in) {  // four layers of an MLP
//     kiln::Tensor h = in[0];
//     for (int i = 0; i < 4; ++i) h = kiln::dropout(kiln::relu(kiln::matmul(h, w[i]) + b[i]), 0.1);
//     return std::vector<kiln::Tensor>{h};
//   };
//   h = kiln::checkpoint(block, {h})[0];  // parameters captured by `block` get gradients too
//
// Automatic: with KILN_MEMORY_BUDGET (flags().memory_budget) set to a size ("512MiB") or to a
// fraction of the plan's arena without a budget ("0.5"), the executor rewrites a plan whose arena
// would exceed the budget so that forward activations are recomputed for the backward, or throws
// kiln::Error saying why it cannot.
#pragma once
#include <functional>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "core/tensor.h"

namespace kiln {

using SegmentFn = std::function<std::vector<Tensor>(const std::vector<Tensor>&)>;

// Runs fn(inputs) now (recorded lazily as usual) and marks its outputs so that autograd
// recomputes the inside of the segment for the backward instead of keeping it. Tensors fn
// captures (e.g. parameters) are kept like inputs and get gradients. Nothing is saved in eager
// mode (KILN_LAZY=0), where every value is computed, and kept, as it is recorded.
std::vector<Tensor> checkpoint(const SegmentFn& fn, const std::vector<Tensor>& inputs);
Tensor checkpoint(const std::function<Tensor(const Tensor&)>& fn, const Tensor& input);

namespace memory {

// A copy of `node` (op, dtype, shape, attributes, scalar, Philox seed and offset) reading
// `inputs`, marked `recompute` so the executor computes it as late as it can.
NodePtr recompute_copy(const Node& node, NodeInputs inputs);

// Copies the inside of `segment` for the backward into `copies` (original -> copy); nodes
// already there keep their copy (an enclosing segment made it).
void recompute_segment(const CheckpointSegment& segment, std::unordered_map<Node*, NodePtr>& copies);

// ---- automatic recomputation under a memory budget ----

// The budget in bytes that flags().memory_budget sets for a plan whose arena without a budget
// (KILN_RECOMPUTE's choice applied) is `unconstrained_arena`; 0 when no budget is set.
int64_t budget_bytes(const std::string& budget, int64_t unconstrained_arena);

// Which forward activations of a pending graph are recomputed: positions in its node list.
struct RecomputeChoice {
  std::vector<int> dropped;
  std::vector<int> checkpoints;  // forward values the copies read as they are (apply_recompute)
  int64_t arena_bytes = 0;  // arena of the rewritten plan
  std::string missed;       // when no choice meets the budget: why (the choice is the smallest arena found)
  std::string policy;       // how the choice was made, for the log
  bool chain_per_value = false;  // each dropped value recomputed on its own (apply_recompute)
};

// The pending graph by position, and the buffer each node's value lives in: its own, or for a
// view (reshape, permute, ...) the one under it; -1 for generators and realized values.
struct GraphIndex {
  const std::vector<NodePtr>& nodes;
  std::vector<int> base;

  // Numbers the nodes by position in their visit_index (as collect_pending leaves them; a walk
  // of a rewritten graph in between may have renumbered them).
  explicit GraphIndex(const std::vector<NodePtr>& graph) : nodes(graph), base(graph.size(), -1) {
    for (size_t i = 0; i < nodes.size(); ++i) nodes[i]->visit_index = static_cast<int64_t>(i);
    for (size_t i = 0; i < nodes.size(); ++i) {
      const Node& n = *nodes[i];
      if (op_kind(n.op) == OpKind::Movement) base[i] = of(n.inputs[0].get()) >= 0 ? base[of(n.inputs[0].get())] : -1;
      else if (op_kind(n.op) != OpKind::Leaf) base[i] = static_cast<int>(i);
    }
  }
  // A node's position, or -1 when it is not in the graph (a realized value: its visit_index
  // counts externals).
  int of(const Node* n) const {
    const int64_t p = n->visit_index;
    return p >= 0 && p < static_cast<int64_t>(nodes.size()) && nodes[p].get() == n ? static_cast<int>(p) : -1;
  }
};

// Rewiring done by apply_recompute, so it can be undone.
struct RecomputeRewrite {
  struct Edit {
    NodePtr consumer;
    size_t input;
    NodePtr original;
  };
  std::vector<Edit> edits;
  int64_t dropped_bytes = 0;     // the dropped values' bytes
  int64_t copied_elements = 0;   // elements the copies compute, one per op (views not counted)
  int64_t copied_flops = 0;      // their work (node_flops)
  std::vector<std::pair<const Node*, const Node*>> copied_from;  // each copy made (views included) and the node it copies
  void undo();
};

// Gives each dropped node (and the forward nodes between it and the kept ones) a recomputed copy
// and points its backward consumers (those recorded without gradient tracking, reading it
// directly or through views; of a value made from inputs alone, those a gradient rule recorded)
// at the copy. A chain of copies stops at kept values: saved activations not dropped, weights,
// values without gradient tracking not made from inputs alone by elementwise work (those are
// copied too, from the inputs), and `checkpoints` (forward values kept for the copies to start
// from although the backward itself does not read them).
// `nodes`: the pending graph, inputs before consumers. With `chain_per_value`, each dropped value
// gets a chain of copies of its own, which lives only until its backward readers have run: a
// dropped value between two checkpoints is recomputed once for itself and again inside the
// chain of each dropped value after it (the work grows with the square of a stretch's length,
// the memory held by the copies does not grow with it: Revolve-style repetition).
RecomputeRewrite apply_recompute(const std::vector<NodePtr>& nodes, const std::vector<int>& dropped,
                                 const std::vector<int>& checkpoints = {}, bool chain_per_value = false);

// The work of computing `n` once, roughly: 2·M·N·K for a matmul, the multiply-adds of a
// convolution or attention, one operation per element (the larger of input and output) for the
// rest. What the budget pass weighs bytes against, and what memory::report() shows.
int64_t node_flops(const Node& n);

// Chooses activations to recompute so the plan fits `budget` bytes. `arena_of_current_graph`
// plans the graph as it is wired now and returns its arena size. Leaves the graph wired as it
// found it (a plan of a rewired graph renumbers its nodes' visit_index: the caller renumbers).
// When no choice fits, returns the one with the smallest arena found and says why in `missed`
// (the caller warns, or throws under KILN_MEMORY_BUDGET_STRICT); a plan that keeps no activation
// for a backward is an Error (nothing to recompute), except that a fraction budget leaves it alone
// (it budgets what a backward keeps). The policy, cheapest first:
//  1. the activations elementwise work gives back from what the backward keeps anyway
//     (choose_cheap_recompute);
//  2. checkpoints: forward values no forward edge jumps over (a transformer's residual stream
//     between sub-blocks, a chain's activations) are kept, and the other saved values of the
//     stretches between them recomputed from them, the stretches that free the most bytes per
//     FLOP (node_flops) first, as few as fit (binary search); then all stretches with only every
//     k-th checkpoint kept, k = 2 up to about 2√n (√n checkpointing);
//  3. for graphs with few checkpoints: every k-th saved value kept in forward order;
//  4. below what √n checkpointing reaches: every saved value but every k-th checkpoint dropped,
//     each with a chain of copies of its own (chain_per_value), k as small as fits (binary
//     search), up to no checkpoint at all: deep chains fit in a few activations' bytes for work
//     that grows with the square of their length. Only choices that copy at most
//     kMaxCopiesPerNode nodes per node of the graph are planned: planning time grows faster than
//     the graph (a 2-layer GPT with 2.6 copies per node: 2 s a plan; 0.8: 0.2 s).
// The first choice that fits is taken (the least recomputation). When none fits, the smallest
// arena found, a choice replacing a cheaper one only where it saves more than
// 1/kWorthwhileSaving of the unconstrained arena beyond it.
inline constexpr int64_t kMaxCopiesPerNode = 2;
inline constexpr int64_t kWorthwhileSaving = 32;
RecomputeChoice choose_recompute(const std::vector<NodePtr>& nodes, int64_t budget, int64_t unconstrained_arena,
                                 const std::string& budget_text,
                                 const std::function<int64_t()>& arena_of_current_graph);

// ---- recomputing what is cheap (KILN_RECOMPUTE) ----

// Saved activations the backward can recompute from what it keeps anyway by elementwise work
// alone: a layer norm's output from its input and statistics; values made with exp, erf, tanh, ...
// only where the backward's elementwise or reduction kernels would compute the copy inside
// themselves, or everywhere with `transcendental` (then also a GELU's output, which a weight
// gradient's matmul reads from memory, from its pre-activation). A saved value is chosen
// when everything its recomputation reads (through elementwise ops and views) is kept for the
// backward already, or is a weight, an input or a constant — so the saved bytes only fall — and
// the work is bounded (kMaxCheapChain ops). Returns positions in `nodes` (inputs before
// consumers) for apply_recompute; the recomputed values are bit-identical to the originals.
inline constexpr int kMaxCheapChain = 16;
inline constexpr int kMaxKeptWalk = 8;  // kept elementwise values looked through for exp, erf, ...
std::vector<int> choose_cheap_recompute(const std::vector<NodePtr>& nodes, bool transcendental);

}  // namespace memory
}  // namespace kiln
