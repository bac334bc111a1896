// The CUDA runtime without (and, where lent, with) a GPU: discovery never crashes, every request
// for a missing device is a clear kiln::Error, and with a device, tensors and modules round-trip
// through device memory bit for bit.
#include <catch2/catch.hpp>

#include <kiln/kiln.h>

#include "backends/cuda/cuda_runtime.h"
#include "memory/allocator.h"

using namespace kiln;

TEST_CASE("CUDA discovery answers without crashing, with a reason when there is no device", "[cuda][device]") {
  if (cuda::available()) {
    REQUIRE(cuda::device_count() > 0);
    CHECK(cuda::unavailable_reason().empty());
    auto info = cuda::device_info(0);
    CHECK(!info.name.empty());
    CHECK(info.major >= 5);
    CHECK(info.total_memory > 0);
  } else {
    CHECK(cuda::device_count() == 0);
    CHECK(!cuda::unavailable_reason().empty());
    WARN("no CUDA device: " << cuda::unavailable_reason());
  }
}

TEST_CASE("asking for a CUDA device that is not there is a clear error", "[cuda][device][errors]") {
  Tensor x = from_vector<float>({1, 2, 3}, {3});
  Device missing = Device::cuda(cuda::device_count());  // one past the last (cuda:0 without a GPU)
  CHECK_THROWS_WITH(x.to(missing), Catch::Contains("to") && Catch::Contains(missing.str()));
  CHECK_THROWS_AS(memory::allocate_storage(64, missing), Error);
  nn::Linear fc(3, 2);
  auto before = fc.weight.to_vector<float>();
  CHECK_THROWS_WITH(fc.to(missing), Catch::Contains("Module::to"));
  CHECK(fc.weight.device().is_cpu());  // nothing moved
  CHECK(fc.weight.to_vector<float>() == before);
  CHECK(x.to(Device::cpu()).node() == x.node());  // already there: the same tensor
}

TEST_CASE("KILN_USE_CUDA without a device fails at the first new tensor, naming the cause", "[cuda][device][errors]") {
  if (cuda::available()) {
    WARN("SKIPPED: this machine has a CUDA device; the no-device path is not reachable here");
    return;
  }
  FlagsGuard guard;
  flags().set("use_cuda", "1");
  CHECK_THROWS_WITH(zeros({2, 2}), Catch::Contains("cuda:0") && Catch::Contains("not available"));
  CHECK_THROWS_WITH(from_vector<float>({1, 2}, {2}), Catch::Contains("cuda:0"));
}

TEST_CASE("tensors and modules round-trip through device memory", "[cuda][device]") {
  if (!cuda::available()) {
    WARN("SKIPPED: no CUDA device (" << cuda::unavailable_reason() << ")");
    return;
  }
  Tensor x = randn({3, 5}).realize();
  Tensor d = x.to(Device::cuda(0));
  CHECK(d.device() == Device::cuda(0));
  CHECK(d.to_vector<float>() == x.to_vector<float>());  // copied back through the host
  CHECK(d.to(Device::cpu()).to_vector<float>() == x.to_vector<float>());
  Tensor e = d + 1.0;  // runs on the device
  CHECK(e.device() == Device::cuda(0));
  auto plus_one = x.to_vector<float>();
  for (float& v : plus_one) v += 1.0f;
  CHECK(e.to_vector<float>() == plus_one);

  nn::Linear fc(5, 2);
  auto w = fc.weight.to_vector<float>();
  fc.to(Device::cuda(0));
  CHECK(fc.weight.device() == Device::cuda(0));
  CHECK(fc.parameters()[0].device() == Device::cuda(0));  // every handle of the variable moved
  fc.to(Device::cpu());
  CHECK(fc.weight.to_vector<float>() == w);
  CHECK(fc.weight.requires_grad());
}

TEST_CASE("host-to-device copies stage through the pinned ring, in pieces when long", "[cuda][device][staging]") {
  if (!cuda::available()) {
    WARN("SKIPPED: no CUDA device (" << cuda::unavailable_reason() << ")");
    return;
  }
  // More than the ring holds, an odd size, then many small copies that wrap around it.
  const size_t n = cuda::kStagingBytes / sizeof(float) * 2 + 12345;
  std::vector<float> host(n);
  for (size_t i = 0; i < n; ++i) host[i] = static_cast<float>(i % 100003) * 0.5f;
  Tensor big = from_vector<float>(host, {static_cast<int64_t>(n)}).to(Device::cuda(0));
  std::vector<Tensor> small;
  for (int i = 0; i < 300; ++i) {
    std::vector<float> v(50000 + static_cast<size_t>(i), static_cast<float>(i));
    small.push_back(from_vector<float>(v, {static_cast<int64_t>(v.size())}).to(Device::cuda(0)));
  }
  CHECK(big.to_vector<float>() == host);
  for (int i = 0; i < 300; ++i) {
    std::vector<float> got = small[static_cast<size_t>(i)].to_vector<float>();
    REQUIRE(got.size() == 50000 + static_cast<size_t>(i));
    CHECK(got.front() == static_cast<float>(i));
    CHECK(got.back() == static_cast<float>(i));
  }
}

TEST_CASE("CUDA events mark points in the stream and time what lies between", "[cuda][device]") {
  if (!cuda::available()) {
    WARN("SKIPPED: no CUDA device (" << cuda::unavailable_reason() << ")");
    return;
  }
  cuda::Event start(0), end(0);
  CHECK(start.done());  // never recorded: nothing to wait for
  CHECK_THROWS_WITH(cuda::Event::elapsed_ms(start, end), Catch::Contains("recorded"));
  start.record();
  Tensor x = randn({1 << 20}).to(Device::cuda(0));
  Tensor y = (exp(x) * 2.0).realize();
  end.record();
  end.synchronize();
  CHECK(end.done());
  CHECK(cuda::Event::elapsed_ms(start, end) >= 0);
  CHECK_THROWS_AS(cuda::Event(cuda::device_count()), Error);
}

TEST_CASE("each device's allocator fills and copies its memory to and from the host", "[cuda][device][memory]") {
  std::vector<Device> devices = {Device::cpu()};
  if (cuda::available()) devices.push_back(Device::cuda(0));
  for (Device d : devices) {
    memory::Allocator& a = memory::device_allocator(d);
    constexpr size_t n = 4096;
    void* p = a.allocate(n);
    REQUIRE(p != nullptr);
    std::vector<unsigned char> in(n), out(n, 0);
    for (size_t i = 0; i < n; ++i) in[i] = static_cast<unsigned char>(i * 7 + 3);
    a.copy_from_host(p, in.data(), n);
    a.copy_to_host(out.data(), p, n);
    CHECK(out == in);
    a.fill(static_cast<char*>(p) + 100, 0xff, 50);
    a.copy_to_host(out.data(), p, n);
    for (size_t i = 0; i < n; ++i) CHECK(out[i] == (i >= 100 && i < 150 ? 0xff : in[i]));
    a.release(p, n);
  }
}
