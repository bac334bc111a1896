# pytorch_saved: the bytes PyTorch's autograd saves for the backward of one step, as the PyTorch
# twins of kiln's samples report them next to kiln's jit::saved_for_backward.
#
#   from pytorch_saved import saved_bytes
#   activations, weights = saved_bytes(lambda: F.cross_entropy(model(x), y), torch.bfloat16)
import torch

# Ops that make a tensor from a parameter without computing anything new: autocast's casts and views.
_COPIES = {"ToCopyBackward0", "TBackward0", "PermuteBackward0", "ExpandBackward0", "ViewBackward0"}


def _from_parameter(t):
    """True for a parameter, or a tensor made from one by casts and views only."""
    if t.is_leaf:
        return t.requires_grad
    fn = t.grad_fn
    while fn is not None and type(fn).__name__ in _COPIES:
        nexts = [f for f, _ in fn.next_functions if f is not None]
        if len(nexts) != 1:
            return False
        fn = nexts[0]
    return fn is not None and type(fn).__name__ == "AccumulateGrad"


def saved_bytes(loss_of, amp_dtype=None):
    """Runs loss_of() (a forward and its loss) under saved_tensors_hooks and returns the bytes
    it saves for the backward, each storage once, as (activations, weights): weights are
    parameters and autocast's copies of them. The caller's inputs should own their storages
    (a slice of the data set would count the whole set)."""
    seen, totals = set(), {"activations": 0, "weights": 0}

    def pack(t):
        key = (t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
        if key not in seen:
            seen.add(key)
            totals["weights" if _from_parameter(t) else "activations"] += key[1]
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with torch.autocast("cpu", dtype=amp_dtype or torch.bfloat16, enabled=amp_dtype is not None):
            loss = loss_of()
    del loss
    return totals["activations"], totals["weights"]
