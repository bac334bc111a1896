// DataParallel: a consistency check and a broadcast at construction, then a gradient reducer
// that the optimizer calls before each update. See data_parallel.h.
#include "distributed/data_parallel.h"

#include <algorithm>
#include <cstring>
#include <unordered_map>

#include "core/autograd.h"
#include "core/error.h"
#include "core/flags.h"
#include "distributed/communicator.h"
#include "ops/ops.h"
#include "ops/primitive.h"

namespace kiln::distributed {

namespace {

constexpr double kFirstBucketBytes = 1 << 20;  // PyTorch DDP's first bucket: the last layers' gradients go early

int64_t bytes_of(const Tensor& t) { return t.numel() * static_cast<int64_t>(dtype_size(t.dtype())); }

BucketPlan plan_buckets(const std::vector<Tensor>& params) {
  BucketPlan plan;
  const double cap = flags().bucket_mb * 1048576.0;
  double filled = 0;
  for (size_t k = params.size(); k-- > 0;) {
    const Tensor& p = params[k];
    const double limit = plan.buckets.size() <= 1 ? std::min(cap, kFirstBucketBytes) : cap;
    bool fits = !plan.buckets.empty() && filled + static_cast<double>(bytes_of(p)) <= limit;
    if (fits) {
      const Tensor& first = params[plan.buckets.back().front()];
      fits = first.dtype() == p.dtype() && first.device() == p.device();
    }
    if (!fits) {
      plan.buckets.emplace_back();
      filled = 0;
    }
    plan.buckets.back().push_back(k);
    filled += static_cast<double>(bytes_of(p));
  }
  return plan;
}

// A digest of one parameter's name, shape and dtype, so that ranks compare parameter lists with
// one small all-gather instead of one message per parameter.
int64_t digest(const std::string& name, const Tensor& t) {
  uint64_t h = 1469598103934665603ull;
  auto mix = [&](uint64_t v) {
    h ^= v;
    h *= 1099511628211ull;
  };
  for (char c : name) mix(static_cast<unsigned char>(c));
  mix(static_cast<uint64_t>(t.dtype()));
  for (int64_t d : t.shape()) mix(static_cast<uint64_t>(d));
  return static_cast<int64_t>(h >> 1);
}

void check_same_parameters(const nn::NamedTensors& named, const Group& group) {
  const int n = group.size();
  if (n == 1) return;
  std::vector<int64_t> mine{static_cast<int64_t>(named.size())};
  for (const auto& [name, t] : named) mine.push_back(digest(name, t));
  // Lists of different lengths cannot be gathered as one block: agree on the length first.
  const Tensor counts = all_gather(from_vector<int64_t>({mine[0]}, {1}), group);
  std::vector<int64_t> c = counts.to_vector<int64_t>();
  for (int r = 0; r < n; ++r)
    KILN_CHECK(c[r] == c[0], "DataParallel", "rank {} has {} parameter tensors but rank {} has {}; every rank must build the same model",
               r, c[r], 0, c[0]);
  std::vector<int64_t> all =
      all_gather(from_vector<int64_t>(mine, {static_cast<int64_t>(mine.size())}), group).to_vector<int64_t>();
  const size_t per = mine.size();
  for (size_t i = 1; i < per; ++i)
    for (int r = 1; r < n; ++r)
      KILN_CHECK(all[r * per + i] == all[i], "DataParallel",
                 "parameter '{}' ({}) differs between rank 0 and rank {} in name, shape or dtype; every rank must "
                 "build the same model",
                 named[i - 1].first, named[i - 1].second.str(), r);
}

// Integers that `t` holds exactly: a step count travels modulo this.
int64_t exact_integers(DType t) {
  switch (t) {
    case DType::Float64: return int64_t{1} << 53;
    case DType::Float16: return int64_t{1} << 11;
    case DType::BFloat16: return int64_t{1} << 8;
    default: return int64_t{1} << 24;
  }
}

// The step tag a rank adds to its first bucket: `world` elements, zero but for this rank's count
// at its own index, so that the bucket's sum tells every rank every rank's count.
Tensor step_tag(int64_t count, const Tensor& like, int world, int rank) {
  std::vector<double> tag(static_cast<size_t>(world), 0.0);
  tag[static_cast<size_t>(rank)] = static_cast<double>(count % exact_integers(like.dtype()));
  return from_vector<double>(tag, {world}).cast(like.dtype()).to(like.device());
}

}  // namespace

class Reducer : public GradientReducer {
 public:
  Reducer(std::vector<Tensor> params, Group group) : params_(std::move(params)), group_(std::move(group)) {
    for (size_t k = 0; k < params_.size(); ++k) index_.emplace(TensorAccess::var(params_[k]).get(), k);
  }

  bool reduce(const std::vector<Tensor>& params, std::vector<Tensor>& grads, const std::vector<Tensor>& along) override {
    ++passes;
    if (accumulate > 1 && !accumulated(grads, along)) return false;
    if (no_sync || group_.size() == 1) return true;
    // Gradients in this wrapper's parameter order (an optimizer may hold a subset, or more).
    std::vector<Tensor> mine(params_.size());
    std::vector<int> where(params_.size(), -1);
    for (size_t i = 0; i < params.size(); ++i)
      if (auto it = index_.find(TensorAccess::var(params[i]).get()); it != index_.end())
        mine[it->second] = grads[i], where[it->second] = static_cast<int>(i);
    const BucketPlan plan = plan_buckets(params_);
    // Every rank all-reduces every bucket, so a parameter without a gradient here (unused in
    // this rank's forward) contributes zeros; one the optimizer does not hold is left out on
    // every rank alike.
    std::vector<std::vector<Tensor>> parts;
    std::vector<std::vector<size_t>> members;
    for (const auto& bucket : plan.buckets) {
      std::vector<Tensor> in_bucket;
      std::vector<size_t> in;
      for (size_t k : bucket) {
        if (where[k] < 0) continue;
        in_bucket.push_back(mine[k].defined() ? mine[k] : zeros_like(params_[k]));
        in.push_back(k);
      }
      if (in_bucket.empty()) continue;
      parts.push_back(std::move(in_bucket));
      members.push_back(std::move(in));
    }
    const int world = group_.size();
    // The first bucket also carries every rank's count of backward passes, checked after the
    // step (after_step): a rank that synced a step the others kept local (no_sync, a different
    // accumulate) pairs its all-reduces with the wrong ones of the others, which MPI cannot see.
    if (!parts.empty()) parts[0].push_back(step_tag(passes, parts[0][0], world, group_.rank()));
    for (size_t b = 0; b < parts.size(); ++b) {
      Tensor reduced;
      if (parts[b][0].device().is_cpu()) {
        // Host gradients: one lazy all-reduce per bucket in the step's own plan, started as soon
        // as the bucket's gradients are computed and waited for before the updates that read it;
        // the rest of the backward runs meanwhile. The planner has each gradient computed straight
        // into its place in the bucket's buffer (no concat kernel, no copy).
        reduced = prim::all_reduce(parts[b], 0, world, group_.id());
      } else {
        // Device gradients go through the host: computed first (with what the step realizes
        // anyway, so nothing is computed twice), then reduced.
        if (b == 0) {
          std::vector<Tensor> realize;
          for (const auto& p : parts)
            for (const Tensor& g : p) realize.push_back(g);
          realize.insert(realize.end(), along.begin(), along.end());
          sync(realize);
        }
        std::vector<Tensor> flat;
        for (const Tensor& g : parts[b]) flat.push_back(g.reshape({g.numel()}));
        reduced = all_reduce(flat.size() == 1 ? flat[0] : concat(flat, 0), ReduceOp::Sum, group_);
      }
      ++all_reduces;
      if (b == 0) tags = reduced.slice(0, reduced.numel() - world, reduced.numel());
      int64_t offset = 0;
      for (size_t k : members[b]) {
        const int64_t n = params_[k].numel();
        grads[static_cast<size_t>(where[k])] =
            reduced.slice(0, offset, offset + n).reshape(params_[k].shape()) / static_cast<double>(world);
        offset += n;
      }
    }
    return true;
  }

  std::vector<Tensor> realized_with_step() override { return tags.defined() ? std::vector<Tensor>{tags} : std::vector<Tensor>{}; }

  void after_step() override {
    if (!tags.defined()) return;
    const std::vector<double> counts = tags.to_doubles();
    const DType dtype = tags.dtype();
    tags = Tensor();
    for (size_t r = 1; r < counts.size(); ++r)
      KILN_CHECK(counts[r] == counts[0], "DataParallel",
                 "the ranks all-reduced gradients of different steps together: rank 0 was at backward pass {} and rank "
                 "{} at pass {} (counted modulo {}); every rank must run the same steps, each with the same no_sync() "
                 "and accumulate(k)",
                 counts[0], r, counts[r], exact_integers(dtype));
  }

  // Gradient accumulation over `accumulate` calls: the first ones add their gradients to sums
  // kept here (realized with the call's own outputs, in its one plan) and return false; the last
  // hands on the mean of all of them and starts again.
  bool accumulated(std::vector<Tensor>& grads, const std::vector<Tensor>& along) {
    if (sums.size() != grads.size()) sums.assign(grads.size(), Tensor());
    for (size_t i = 0; i < grads.size(); ++i)
      if (grads[i].defined()) sums[i] = sums[i].defined() ? sums[i] + grads[i] : grads[i];
    if (++calls < accumulate) {
      std::vector<Tensor> realize = along;
      for (const Tensor& s : sums)
        if (s.defined()) realize.push_back(s);
      sync(realize);
      return false;
    }
    for (size_t i = 0; i < grads.size(); ++i)
      grads[i] = sums[i].defined() ? sums[i] / static_cast<double>(accumulate) : Tensor();
    sums.clear();
    calls = 0;
    return true;
  }

  std::vector<Tensor> params_;
  Group group_;                                   // the replicas that average their gradients
  std::unordered_map<const Var*, size_t> index_;  // a parameter's position in params_
  bool no_sync = false;
  int64_t all_reduces = 0;
  int64_t passes = 0;  // reduce() calls: backward passes, synced or not
  Tensor tags;         // the first bucket's summed step tags, until after_step() reads them
  int64_t accumulate = 1, calls = 0;
  std::vector<Tensor> sums;  // gradients accumulated so far (per optimizer gradient)
};

DataParallel::DataParallel(nn::AnyModule module, Group group)
    : nn::Module(static_cast<const nn::Module&>(module)), module_(std::move(module)) {
  init();
  group.require_me("DataParallel");
  const nn::NamedTensors named = module_.named_parameters();
  check_same_parameters(named, group);
  if (group.size() > 1) {
    NoGradGuard no_grad;
    std::vector<Tensor> received;
    for (auto [name, p] : named) {
      Tensor value = broadcast(p, 0, group);
      p.assign(value);
      received.push_back(p);
    }
    for (auto [name, b] : module_.named_buffers()) {
      b.assign(broadcast(b, 0, group));
      received.push_back(b);
    }
    if (!received.empty()) sync(received);
  }
  std::vector<Tensor> params;
  for (const auto& [name, p] : named) params.push_back(p);
  reducer_ = std::make_shared<Reducer>(std::move(params), std::move(group));
  for (const Tensor& p : reducer_->params_) set_gradient_reducer(p, reducer_);
}

BucketPlan DataParallel::bucket_plan() const { return plan_buckets(reducer_->params_); }

void DataParallel::accumulate(int64_t k) {
  KILN_CHECK(k >= 1, "DataParallel::accumulate", "needs a positive number of micro-batches per step, got {}", k);
  KILN_CHECK(reducer_->calls == 0, "DataParallel::accumulate",
             "{} of {} micro-batches are accumulated; change the count after a step", reducer_->calls,
             reducer_->accumulate);
  reducer_->accumulate = k;
}
int64_t DataParallel::all_reduce_count() const { return reducer_->all_reduces; }

NoSyncGuard::NoSyncGuard(DataParallel& model) : reducer_(model.reducer_), previous_(reducer_->no_sync) {
  reducer_->no_sync = true;
}
NoSyncGuard::~NoSyncGuard() { reducer_->no_sync = previous_; }

}  // namespace kiln::distributed
