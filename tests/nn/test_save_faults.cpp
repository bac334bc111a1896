// Checkpoints survive the process dying while it writes one: nn::save writes a temporary file,
// fsyncs it and renames it over the old one, so whatever moment a kill -9 lands at, the path holds
// the previous checkpoint or the new one, whole; a write that fails half way (a full disk) leaves
// the previous one too.
#include <catch2/catch.hpp>

#include <sys/resource.h>
#include <fcntl.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <random>
#include <thread>

#include <kiln/kiln.h>

#include "tests/support/child_process.h"
#include "tests/support/files.h"

using namespace kiln;

namespace {

// A model of about 8 MiB in four layers, so that writing it takes many write() calls.
nn::Sequential big_model() {
  return nn::Sequential(nn::Linear(512, 1024), nn::Linear(1024, 1024), nn::Linear(1024, 512), nn::Linear(512, 256));
}

// Every parameter of `net` set to `version`: the file then says which save wrote it.
void set_version(nn::Module& net, double version) {
  NoGradGuard no_grad;
  std::vector<Tensor> params = net.parameters();
  for (Tensor& p : params) p.assign(full(p.shape(), version, p.dtype()));
  sync(params);
}

// The version every tensor of the checkpoint at `path` holds; fails the test on a file that does
// not load, or that mixes versions (half of one save, half of another).
double version_of(const std::string& path, size_t tensors) {
  nn::TensorMap loaded;
  REQUIRE_NOTHROW(loaded = nn::load_tensors(path));
  REQUIRE(loaded.size() == tensors);
  std::vector<double> seen;
  for (const auto& [name, t] : loaded) {
    std::vector<double> values = t.to_doubles();
    REQUIRE(!values.empty());
    const auto other = std::find_if(values.begin(), values.end(), [&](double v) { return v != values.front(); });
    INFO(name << " holds " << (other == values.end() ? values.front() : *other) << " beside " << values.front());
    REQUIRE(other == values.end());
    seen.push_back(values.front());
  }
  for (double v : seen) REQUIRE(v == seen.front());
  return seen.front();
}

void remove_with_temporaries(const std::string& path) {
  namespace fs = std::filesystem;
  std::error_code error;
  const fs::path p(path);
  for (const auto& entry : fs::directory_iterator(p.parent_path(), error))
    if (entry.path().filename().string().rfind(p.filename().string(), 0) == 0) fs::remove(entry.path(), error);
}

}  // namespace

// The child of the test below: saves the model to KILN_TEST_SAVE_PATH over and over, each time
// with the next version (1, 2, 3, ...), until it is killed. Writes one byte to descriptor 3 when
// it starts its first save.
TEST_CASE("nn save loop child", "[.][fault-child]") {
  const char* path = std::getenv("KILN_TEST_SAVE_PATH");
  if (path == nullptr) return;  // run by hand: nothing to do
  nn::Sequential net = big_model();
  set_version(net, 1);
  const char ready = 'r';
  REQUIRE(::write(3, &ready, 1) == 1);
  ::close(3);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);  // if never killed
  for (int version = 1; std::chrono::steady_clock::now() < deadline; ++version) {
    set_version(net, version);
    nn::save(net, path);
  }
}

TEST_CASE("kill -9 during nn::save leaves the previous checkpoint or the new one, whole", "[nn][faults]") {
  const std::string path = testing::temp_path("kiln_kill9", "model.safetensors");
  nn::Sequential net = big_model();
  set_version(net, 0);
  nn::save(net, path);
  const size_t tensors = net.state().size();
  std::random_device seed;
  std::mt19937 rng(seed());
  std::vector<double> versions;
  for (int round = 0; round < 6; ++round) {
    int fds[2];
    REQUIRE(::pipe2(fds, O_CLOEXEC) == 0);
    testing::ChildGuard child{testing::spawn_test_child("nn save loop child", {"KILN_TEST_SAVE_PATH=" + path}, fds[1])};
    ::close(fds[1]);
    REQUIRE(child.pid > 0);
    char ready = 0;
    const ssize_t got = ::read(fds[0], &ready, 1);
    ::close(fds[0]);
    REQUIRE(got == 1);
    // A random moment within the first few saves: before, inside or between writes and renames.
    const int delay_ms = static_cast<int>(rng() % 400);
    INFO("round " << round << ": killed " << delay_ms << " ms after the child started saving");
    std::this_thread::sleep_for(std::chrono::milliseconds(delay_ms));
    REQUIRE(::kill(child.pid, SIGKILL) == 0);
    CHECK(testing::wait_child(child.pid) == 128 + SIGKILL);
    child.pid = -1;
    versions.push_back(version_of(path, tensors));
  }
  // Whatever the rounds saw, the last file still loads into the model.
  CHECK_NOTHROW(nn::load(net, path));
  // The next save removes what the killed savers left beside it.
  const std::string stale = path + ".tmp.999999999";  // above any pid_max: no such process
  std::ofstream(stale) << "partial";
  nn::save(net, path);
  size_t left = 0;
  for (const auto& entry : std::filesystem::directory_iterator(std::filesystem::path(path).parent_path()))
    if (entry.path().filename().string().rfind(std::filesystem::path(path).filename().string() + ".tmp", 0) == 0) ++left;
  CHECK(left == 0);
  INFO("versions found after each kill: " << fmt::format("{}", fmt::join(versions, ", ")));
  remove_with_temporaries(path);
}

TEST_CASE("a save that fails half way (a full disk) leaves the previous checkpoint", "[nn][faults]") {
  const std::string path = testing::temp_path("kiln_fsize", "model.safetensors");
  nn::Sequential net = big_model();
  set_version(net, 3);
  nn::save(net, path);
  const size_t tensors = net.state().size();
  set_version(net, 4);
  {
    // Files of this process may grow to 1 MiB only: the write fails part way with EFBIG, as it
    // would with ENOSPC on a full disk. SIGXFSZ would otherwise end the process.
    struct rlimit before {};
    REQUIRE(::getrlimit(RLIMIT_FSIZE, &before) == 0);
    struct rlimit small = before;
    small.rlim_cur = 1 << 20;
    auto* previous_handler = ::signal(SIGXFSZ, SIG_IGN);
    REQUIRE(::setrlimit(RLIMIT_FSIZE, &small) == 0);
    std::string message;
    try {
      nn::save(net, path);
    } catch (const Error& e) {
      message = e.what();
    }
    ::setrlimit(RLIMIT_FSIZE, &before);
    ::signal(SIGXFSZ, previous_handler);
    CHECK_THAT(message, Catch::Contains("save") && Catch::Contains("File too large"));
  }
  CHECK(version_of(path, tensors) == 3);
  // No temporary is left behind by a save that failed.
  size_t left = 0;
  for (const auto& entry : std::filesystem::directory_iterator(std::filesystem::path(path).parent_path()))
    if (entry.path().filename().string().rfind(std::filesystem::path(path).filename().string() + ".tmp", 0) == 0) ++left;
  CHECK(left == 0);
  remove_with_temporaries(path);
}
