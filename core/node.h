// A graph node: one primitive op applied to input nodes, with the shape and dtype of its result.
// Nodes are immutable values; once realized they hold a Storage and drop their inputs (unless
// autograd may still need the graph). Tensor handles point at nodes through a Var.
#pragma once
#include <atomic>
#include <memory>
#include <vector>

#include "core/block_cache.h"
#include "core/device.h"
#include "core/dtype.h"
#include "core/op.h"
#include "core/shape.h"
#include "core/trace_label.h"

namespace kiln {

// Realized memory of one node. The deleter comes from memory/ (pool or plain allocation).
struct Storage {
  void* data = nullptr;
  size_t bytes = 0;
  Device device;
  void (*release)(void* data, size_t bytes, Device device) = nullptr;

  Storage() = default;
  Storage(const Storage&) = delete;
  Storage& operator=(const Storage&) = delete;
  ~Storage() {
    if (release && data) release(data, bytes, device);
  }
};

struct Var;
struct Node;
// Whether a value recorded now is kept as int8 if the backward saves it (memory/compress.h):
// CompressActivationsGuard's setting where one is active, else KILN_COMPRESS_ACTIVATIONS.
bool compressing_activations();
// Whether autograd is recording a backward pass now (core/autograd.cc).
bool recording_backward();
class GradientReducer;  // core/autograd.h
using NodePtr = std::shared_ptr<Node>;
// A node's inputs: a std::vector whose few elements live in recycled blocks (core/block_cache.h).
using NodeInputs = std::vector<NodePtr, ShortArrayAllocator<NodePtr>>;

// One kiln::checkpoint call (memory/recompute.h): the nodes its function recorded (ids strictly
// between first_id and last_id) lie between `inputs` and `outputs`; autograd recomputes them
// instead of keeping them for the backward.
struct CheckpointSegment {
  std::vector<NodePtr> inputs;
  std::vector<std::weak_ptr<Node>> outputs;  // weak: the outputs point here
  uint64_t first_id = 0, last_id = 0;
};

struct Node : std::enable_shared_from_this<Node> {
  // User-provided, so `new_node()` does not zero the whole node before the member initializers
  // run (every member has one; recording pays for each byte written).
  Node() {}
  Node(const Node&) = default;

  Op op = Op::Input;
  DType dtype = DType::Float32;
  Device device;
  Shape shape;
  NodeInputs inputs;
  std::vector<int64_t> ints;  // attributes: axes (reduce), perm, slice starts+steps, pad before+after
  double scalar = 0;          // Full: the value (bound at run time, not part of the plan key)
  uint64_t seed = 0;          // Rand*: Philox key; Rand* counter base is `offset` (both bound at run time)
  uint64_t offset = 0;
  std::shared_ptr<Storage> storage;  // set once realized

  int held = 0;                // how many Vars (user handles) point here
  bool requires_grad = false;  // a gradient leaf is upstream of this node
  bool grad_leaf = false;      // autograd stops here; gradient goes to `var`
  bool backward_done = false;  // a backward pass was built through this node: once realized it
                               // needs no history (PyTorch's retain_graph=False)
  std::weak_ptr<Node> replaces;  // set by assign(): the variable's previous value, whose buffer
                                 // the executor may update in place when nothing else can see it
  std::weak_ptr<Var> var;      // for grad leaves: the variable whose .grad() accumulates
  // Recomputation: set on each output of a checkpoint segment; `recompute` marks a copy of a
  // forward node made for the backward (or the backward's reading of a compressed value), which
  // the executor computes as late as it can.
  std::shared_ptr<const CheckpointSegment> segment;
  bool recompute = false;
  // Compression (memory/compress.h): `compress` marks a value recorded while it was on; the
  // executor gives such a value, if the backward reads it, an int8 (or 1-bit mask) copy that the
  // backward reads instead. `saved_copy` marks the nodes computing that copy: forward work the
  // executor runs as soon as it can, so the full-width value dies with its last forward reader.
  bool compress = compressing_activations();
  bool saved_copy = false;
  bool backward = recording_backward();  // recorded by a gradient rule
  uint32_t label = current_trace_label();  // core/trace_label.h: the kernel that computes it shows it
  uint64_t id = next_id();
  // Scratch space of graph walks (the executor's collect pass): valid when visit == the walk's
  // epoch, so a walk needs no hash map.
  uint64_t visit = 0;
  int64_t visit_index = 0;

  bool realized() const { return storage != nullptr; }
  int64_t numel() const { return kiln::numel(shape); }
  size_t nbytes() const { return static_cast<size_t>(numel()) * dtype_size(dtype); }

  static uint64_t next_id() {
    static std::atomic<uint64_t> counter{0};
    return ++counter;
  }
};

// A new node (arguments as Node's constructors take them), in recycled memory (core/block_cache.h).
template <class... Args>
NodePtr new_node(Args&&... args) {
  return std::allocate_shared<Node>(PooledAllocator<Node>(), std::forward<Args>(args)...);
}

// A variable: what a Tensor handle refers to. Ops read its current node; assign() points it at a
// new node, so every handle sharing the variable (a module, its optimizer) sees the update.
struct Var {
  NodePtr node;
  std::shared_ptr<Var> grad;  // accumulated gradient (a lazy node until realized)
  bool requires_grad = false;
  // Autocast's copy of this variable's value in a low-precision type (ops/autocast.h): current
  // while low_copy_of is `node`; low_copy_used says a forward read it since the optimizer last
  // refreshed it. Not a handle (held is not counted): the executor keeps no pending copy.
  NodePtr low_copy;
  std::weak_ptr<Node> low_copy_of;
  bool low_copy_used = false;
  // Transforms this parameter's gradient before an optimizer applies it (data parallel's
  // all-reduce); weak: the reducer's owner (a DataParallel) decides how long it applies.
  std::weak_ptr<GradientReducer> reducer;

  explicit Var(NodePtr n) { set(std::move(n)); }
  ~Var() {
    if (node) --node->held;
  }
  Var(const Var&) = delete;
  Var& operator=(const Var&) = delete;
  void set(NodePtr n) {
    if (n) ++n->held;
    if (node) --node->held;
    node = std::move(n);
  }
};

}  // namespace kiln
