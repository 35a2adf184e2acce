// The NCCL backend on two GPUs (ranks as threads, one device each), against the same
// single-process results as Gloo. Without two GPUs these tests skip and say why; in a build
// without CUDA they first check that asking for NCCL is an Error.
#include <gtest/gtest.h>

#include <latch>
#include <thread>

#include <cstdlib>
#include <filesystem>

#include "comm/launch_env.h"
#include "comm/launcher.h"
#include "comm/nccl_communicator.h"
#include "comm/store.h"
#include "core/cuda_runtime.h"

namespace moetrain {
namespace {

using namespace std::chrono_literals;

// Skips unless this build has NCCL and the machine two GPUs.
bool skip_without_two_gpus() {
  if (!nccl_built()) {
    auto store = Store::open("memory", 0, 1s);
    EXPECT_THROW(connect_nccl(store, 0, 1, 0, CommOptions{}), Error);
    return true;
  }
  return !cuda::available() || cuda::device_count() < 2;
}

std::string skip_reason() {
  if (!nccl_built()) return "no GPU: this build has no CUDA, so no NCCL backend";
  if (!cuda::available()) return "no GPU: " + cuda::unavailable_reason();
  return "no GPU: the NCCL tests need 2 GPUs, this machine has " + std::to_string(cuda::device_count());
}

// Runs `body` on ranks 0 and 1, rank r on GPU r, over one in-memory store.
void run_two(const std::function<void(Communicator&)>& body, CommOptions opt = {}) {
  opt.timeout = 60s;
  auto store = Store::open("memory", 0, opt.timeout);
  std::string errors[2];
  std::latch done(2);
  std::thread threads[2];
  for (int r = 0; r < 2; ++r) {
    threads[r] = std::thread([&, r] {
      std::unique_ptr<Communicator> comm;
      try {
        comm = connect_nccl(store, r, 2, r, opt);
        body(*comm);
        comm->synchronize();
      } catch (const std::exception& e) {
        errors[r] = e.what();
      }
      done.arrive_and_wait();
    });
  }
  for (auto& t : threads) t.join();
  for (int r = 0; r < 2; ++r) EXPECT_EQ(errors[r], "") << "rank " << r;
}

Tensor on_gpu(const Tensor& cpu, int device) { return cpu.to(Device::cuda(device)); }

TEST(CommNccl, CollectivesMatchTheSerialResults) {
  if (skip_without_two_gpus()) GTEST_SKIP() << skip_reason();
  run_two([](Communicator& c) {
    const int r = c.rank();
    const int dev = r;
    for (DType dt : {DType::F32, DType::BF16, DType::F64, DType::I32, DType::I64}) {
      // all_reduce sum and max of small integers: exact in every type.
      Tensor t = on_gpu(Tensor::from_vector<double>({1.0 + r, -2.0 * r, 3.0}, {3}).to(dt), dev);
      c.all_reduce(t);
      EXPECT_EQ(t.to(Device::cpu()).to_double_vector(), (std::vector<double>{3, -2, 6})) << dtype_name(dt);
      Tensor m = on_gpu(Tensor::from_vector<double>({1.0 * r, -1.0 * r}, {2}).to(dt), dev);
      c.all_reduce(m, ReduceOp::Max);
      EXPECT_EQ(m.to(Device::cpu()).to_double_vector(), (std::vector<double>{1, 0})) << dtype_name(dt);
      // reduce_scatter: rank r gets the sum of chunk r.
      Tensor in = on_gpu(Tensor::from_vector<double>({1.0, 2.0, 10.0 + r, 20.0}, {4}).to(dt), dev);
      Tensor out = Tensor::empty({2}, dt, Device::cuda(dev));
      c.reduce_scatter(in, out);
      std::vector<double> want = r == 0 ? std::vector<double>{2, 4} : std::vector<double>{21, 40};
      EXPECT_EQ(out.to(Device::cpu()).to_double_vector(), want) << dtype_name(dt);
      // all_gather
      Tensor g_in = on_gpu(Tensor::from_vector<double>({1.0 * r, 5.0}, {2}).to(dt), dev);
      Tensor g_out = Tensor::empty({4}, dt, Device::cuda(dev));
      c.all_gather(g_in, g_out);
      EXPECT_EQ(g_out.to(Device::cpu()).to_double_vector(), (std::vector<double>{0, 5, 1, 5})) << dtype_name(dt);
    }
    // all_to_all_v with a zero count: rank 0 sends 2 rows to itself and none to rank 1;
    // rank 1 sends 1 row to rank 0 and 1 to itself.
    std::vector<int64_t> send = r == 0 ? std::vector<int64_t>{2, 0} : std::vector<int64_t>{1, 1};
    std::vector<int64_t> recv = r == 0 ? std::vector<int64_t>{2, 1} : std::vector<int64_t>{0, 1};
    std::vector<double> rows = r == 0 ? std::vector<double>{1, 1, 2, 2} : std::vector<double>{3, 3, 4, 4};
    Tensor a_in = on_gpu(Tensor::from_vector<double>(rows, {static_cast<int64_t>(rows.size() / 2), 2}).to(DType::F32), dev);
    Tensor a_out = Tensor::empty({r == 0 ? 3 : 1, 2}, DType::F32, Device::cuda(dev));
    c.all_to_all_v(a_in, send, a_out, recv);
    std::vector<double> a_want = r == 0 ? std::vector<double>{1, 1, 2, 2, 3, 3} : std::vector<double>{4, 4};
    EXPECT_EQ(a_out.to(Device::cpu()).to_double_vector(), a_want);
    // broadcast from rank 1, send/recv, barrier
    Tensor b = on_gpu(Tensor::from_vector<float>({1.0f * r + 7}, {1}), dev);
    c.broadcast(b, 1);
    EXPECT_EQ(b.to(Device::cpu()).item(), 8.0);
    Tensor p = on_gpu(Tensor::from_vector<float>({r == 0 ? 42.0f : 0.0f}, {1}), dev);
    if (r == 0) c.send(p, 1);
    else c.recv(p, 0);
    EXPECT_EQ(p.to(Device::cpu()).item(), 42.0);
    c.barrier();
    // split: each rank alone in its own group
    auto solo = c.split(r, 0, "solo");
    ASSERT_TRUE(solo);
    EXPECT_EQ(solo->size(), 1);
    EXPECT_EQ(solo->name(), "world/solo");
  });
}

// Rank 1 never enters the all-reduce: rank 0's synchronize gives up after the timeout with
// an Error naming the op, instead of hanging (the process is kept: abort_process_on_error off).
TEST(CommNccl, APeerThatNeverJoinsTimesOut) {
  if (skip_without_two_gpus()) GTEST_SKIP() << skip_reason();
  CommOptions opt;
  opt.abort_process_on_error = false;
  opt.timeout = 5s;
  auto store = Store::open("memory", 0, 60s);
  std::string error;
  std::latch rank0_done(1), connected(2);
  std::thread r1([&] {
    auto comm = connect_nccl(store, 1, 2, 1, opt);
    connected.arrive_and_wait();
    rank0_done.wait();
  });
  {
    auto comm = connect_nccl(store, 0, 2, 0, opt);
    connected.arrive_and_wait();
    Tensor t = Tensor::zeros({1024}, DType::F32, Device::cuda(0));
    try {
      comm->all_reduce(t);
      comm->synchronize();
    } catch (const Error& e) {
      error = e.what();
    }
    rank0_done.count_down();
  }
  r1.join();
  EXPECT_NE(error.find("on world (rank 0 of 2)"), std::string::npos) << error;
}

// Two processes, one GPU each, meeting through the store launch_workers made: the path of
// `moetrain launch -n 2 -- comm-selftest --backend nccl`.
TEST(CommNccl, ProcessesMeetThroughTheLauncher) {
  if (std::getenv("MOETRAIN_TEST_NCCL_WORKER")) {
    LaunchEnv env = LaunchEnv::from_environment();
    auto store = Store::open(default_store_spec(env), env.rank, 60s);
    auto comm = connect_nccl(store, env.rank, env.world_size, env.local_rank, default_comm_options(env));
    Tensor t = Tensor::full({1000}, env.rank + 1, DType::BF16, Device::cuda(env.local_rank));
    comm->all_reduce(t);
    comm->synchronize();
    EXPECT_EQ(t.to(Device::cpu()).item(999), 3.0);
    return;
  }
  if (skip_without_two_gpus()) GTEST_SKIP() << skip_reason();
  LaunchSpec spec;
  spec.nproc = 2;
  spec.argv = {std::filesystem::read_symlink("/proc/self/exe").string(),
               "--gtest_filter=CommNccl.ProcessesMeetThroughTheLauncher"};
  spec.env = {{"MOETRAIN_TEST_NCCL_WORKER", "1"}};
  std::string output;
  spec.on_line = [&](int rank, int, const std::string& line) { output += std::to_string(rank) + ": " + line + "\n"; };
  LaunchResult r = launch_workers(spec);
  EXPECT_EQ(r.exit_code, 0) << r.message << "\n" << output;
  EXPECT_NE(output.find("0: [  PASSED  ] 1 test"), std::string::npos) << output;
  EXPECT_NE(output.find("1: [  PASSED  ] 1 test"), std::string::npos) << output;
}

}  // namespace
}  // namespace moetrain
