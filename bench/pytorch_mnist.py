# PyTorch baseline for samples/train_mnist: the same MLP 784-512-512-10, SGD (lr 0.05, momentum 0.9),
# batch 128, 2 threads, one epoch of Fashion-MNIST from the Debian package; prints examples/s and test accuracy.
import gzip, time, numpy as np, torch
torch.set_num_threads(2); torch.manual_seed(0)
d = "/usr/share/datasets/fashion-mnist/"
def imgs(f): return np.frombuffer(gzip.open(d+f).read(), np.uint8, offset=16).reshape(-1, 784).astype(np.float32) / 255
def labs(f): return np.frombuffer(gzip.open(d+f).read(), np.uint8, offset=8).astype(np.int64)
X, Y = torch.from_numpy(imgs("train-images-idx3-ubyte.gz")), torch.from_numpy(labs("train-labels-idx1-ubyte.gz"))
Xt, Yt = torch.from_numpy(imgs("t10k-images-idx3-ubyte.gz")), torch.from_numpy(labs("t10k-labels-idx1-ubyte.gz"))
m = torch.nn.Sequential(torch.nn.Linear(784, 512), torch.nn.ReLU(), torch.nn.Linear(512, 512), torch.nn.ReLU(), torch.nn.Linear(512, 10))
opt = torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)
perm = torch.randperm(60000); t0 = time.time(); n = 0
for i in range(0, 60000 - 127, 128):
    idx = perm[i:i+128]; x, y = X[idx], Y[idx]
    loss = torch.nn.functional.cross_entropy(m(x), y); opt.zero_grad(); loss.backward(); opt.step(); loss.item(); n += 128
dt = time.time() - t0
with torch.no_grad(): acc = (m(Xt).argmax(1) == Yt).float().mean().item()
print(f"pytorch {torch.__version__}: {n/dt:.0f} examples/s, test accuracy {100*acc:.2f}%")
