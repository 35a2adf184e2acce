// The Gloo communicator against the obvious single-process results: N ranks as threads,
// each with its own Gloo context over a shared file store on loopback.
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <limits>

#include "comm/mesh.h"
#include "comm_test_util.h"
#include "test_util.h"

namespace moetrain {
namespace {

using testing::run_ranks;
using testing::test_options;

const DType kAllTypes[] = {DType::F32, DType::F64, DType::BF16, DType::I32, DType::I64};

// Rank r's input: normals for floating types (rounded to the type), integers in [-50, 50)
// for integer types; different on every rank.
Tensor input_for(int rank, DType dt, int64_t n, uint64_t salt = 0) {
  if (!is_floating(dt)) {
    return testing::random_ints({n}, -50, 50, 1000 + rank * 31 + salt).to(dt);
  }
  return testing::random_tensor({n}, DType::F64, 2000 + rank * 17 + salt).to(dt);
}

// Element i reduced over ranks 0..P-1 in rank order, accumulated as the backend promises
// (f32 for bf16, then rounded once), as a double.
std::vector<double> serial_reduce(int P, DType dt, int64_t n, ReduceOp op, uint64_t salt = 0) {
  std::vector<std::vector<double>> in;
  for (int r = 0; r < P; ++r) in.push_back(input_for(r, dt, n, salt).to_double_vector());
  std::vector<double> out(n);
  for (int64_t i = 0; i < n; ++i) {
    if (dt == DType::F32 || dt == DType::BF16) {
      float acc = static_cast<float>(in[0][i]);
      for (int r = 1; r < P; ++r) {
        float x = static_cast<float>(in[r][i]);
        acc = op == ReduceOp::Sum ? acc + x : std::max(acc, x);
      }
      out[i] = dt == DType::BF16 ? static_cast<float>(bf16(acc)) : acc;
    } else {
      double acc = in[0][i];
      for (int r = 1; r < P; ++r) acc = op == ReduceOp::Sum ? acc + in[r][i] : std::max(acc, in[r][i]);
      out[i] = acc;
    }
  }
  return out;
}

class CommGlooAllReduce : public ::testing::TestWithParam<int> {};

// Bitwise equal to the serial sum, for every dtype, on sizes that do not divide evenly,
// that are smaller than the world, and empty.
TEST_P(CommGlooAllReduce, SumAndMaxEqualTheSerialResult) {
  const int P = GetParam();
  run_ranks(P, [&](Communicator& c) {
    for (DType dt : kAllTypes) {
      for (int64_t n : {int64_t{13}, int64_t{P - 1}, int64_t{0}, int64_t{1000}}) {
        for (ReduceOp op : {ReduceOp::Sum, ReduceOp::Max}) {
          Tensor t = input_for(c.rank(), dt, n);
          c.all_reduce(t, op);
          EXPECT_EQ(t.to_double_vector(), serial_reduce(P, dt, n, op))
              << dtype_name(dt) << " n=" << n << " " << reduce_op_name(op) << " rank " << c.rank();
        }
      }
    }
  });
}

INSTANTIATE_TEST_SUITE_P(Ranks, CommGlooAllReduce, ::testing::Values(1, 2, 3, 4));

TEST(CommGloo, MaxPropagatesNaN) {
  run_ranks(3, [](Communicator& c) {
    Tensor t = Tensor::from_vector<float>({1.0f * c.rank(), c.rank() == 1 ? NAN : 0.0f, -1.0f}, {3});
    c.all_reduce(t, ReduceOp::Max);
    EXPECT_EQ(t.item(0), 2.0);
    EXPECT_TRUE(std::isnan(t.item(1))) << "a NaN on rank 1 must reach every rank";
    EXPECT_EQ(t.item(2), -1.0);
  });
}

TEST(CommGloo, ReduceScatterGivesEachRankItsChunk) {
  const int P = 3;
  const int64_t chunk = 5;
  run_ranks(P, [&](Communicator& c) {
    for (DType dt : kAllTypes) {
      for (ReduceOp op : {ReduceOp::Sum, ReduceOp::Max}) {
        Tensor in = input_for(c.rank(), dt, P * chunk, 7);
        Tensor out = Tensor::empty({chunk}, dt);
        c.reduce_scatter(in, out, op);
        std::vector<double> all = serial_reduce(P, dt, P * chunk, op, 7);
        std::vector<double> mine(all.begin() + c.rank() * chunk, all.begin() + (c.rank() + 1) * chunk);
        EXPECT_EQ(out.to_double_vector(), mine) << dtype_name(dt) << " " << reduce_op_name(op);
      }
    }
  });
}

TEST(CommGloo, AllGatherConcatenatesInRankOrder) {
  const int P = 4;
  run_ranks(P, [&](Communicator& c) {
    for (DType dt : kAllTypes) {
      Tensor in = input_for(c.rank(), dt, 6).view({2, 3});
      Tensor out = Tensor::empty({2 * P, 3}, dt);
      c.all_gather(in, out);
      std::vector<double> expected;
      for (int r = 0; r < P; ++r) {
        auto v = input_for(r, dt, 6).to_double_vector();
        expected.insert(expected.end(), v.begin(), v.end());
      }
      EXPECT_EQ(out.to_double_vector(), expected) << dtype_name(dt);
    }
  });
}

// rows[s][d]: rows rank s sends to rank d. Uneven, with zeros, and rank 2 of 4 neither
// sends nor receives anything.
int64_t rows_between(int s, int d) {
  if (s == 2 || d == 2) return 0;
  return (s * 3 + d * 5 + 1) % 4;
}

// Small integers (< 256), so bf16 holds them exactly.
double cell(int s, int d, int64_t row, int col) { return s * 64 + d * 16 + row * 4 + col; }

TEST(CommGloo, AllToAllVMovesUnevenRowsIncludingNone) {
  const int P = 4, W = 3;
  run_ranks(P, [&](Communicator& c) {
    const int me = c.rank();
    for (DType dt : kAllTypes) {
      std::vector<int64_t> send(P), recv(P);
      std::vector<double> in_vals, expected;
      for (int p = 0; p < P; ++p) {
        send[p] = rows_between(me, p);
        recv[p] = rows_between(p, me);
        for (int64_t k = 0; k < send[p]; ++k) {
          for (int col = 0; col < W; ++col) in_vals.push_back(cell(me, p, k, col));
        }
        for (int64_t k = 0; k < recv[p]; ++k) {
          for (int col = 0; col < W; ++col) expected.push_back(cell(p, me, k, col));
        }
      }
      int64_t in_rows = static_cast<int64_t>(in_vals.size()) / W;
      Tensor in = Tensor::from_vector<double>(in_vals, {in_rows, W}).to(dt);
      Tensor out = Tensor::full({static_cast<int64_t>(expected.size()) / W, W}, -1, dt);
      c.all_to_all_v(in, send, out, recv);
      EXPECT_EQ(out.to_double_vector(), expected) << dtype_name(dt) << " rank " << me;
    }
  });
}

TEST(CommGloo, BroadcastCopiesTheRoot) {
  run_ranks(3, [](Communicator& c) {
    for (DType dt : kAllTypes) {
      Tensor t = input_for(c.rank(), dt, 9);
      c.broadcast(t, 1);
      EXPECT_EQ(t.to_double_vector(), input_for(1, dt, 9).to_double_vector()) << dtype_name(dt);
    }
  });
}

// Even ranks send first and odd ranks receive first: a send returns once the peer took it.
TEST(CommGloo, SendRecvAroundARing) {
  const int P = 4;
  run_ranks(P, [&](Communicator& c) {
    const int next = (c.rank() + 1) % P, prev = (c.rank() + P - 1) % P;
    Tensor mine = input_for(c.rank(), DType::BF16, 17);
    Tensor got = Tensor::zeros({17}, DType::BF16);
    if (c.rank() % 2 == 0) {
      c.send(mine, next);
      c.recv(got, prev);
    } else {
      c.recv(got, prev);
      c.send(mine, next);
    }
    EXPECT_EQ(got.to_double_vector(), input_for(prev, DType::BF16, 17).to_double_vector());
  });
}

TEST(CommGloo, BarrierWaitsForEveryRank) {
  std::atomic<int> arrived{0};
  run_ranks(3, [&](Communicator& c) {
    if (c.rank() == 2) std::this_thread::sleep_for(std::chrono::milliseconds(200));
    arrived++;
    c.barrier();
    EXPECT_EQ(arrived.load(), 3) << "rank " << c.rank() << " left the barrier early";
  });
}

TEST(CommGloo, BadArgumentsNameTheOpAndTensor) {
  run_ranks(2, [](Communicator& c) {
    Tensor a = Tensor::zeros({4}, DType::F32), b = Tensor::zeros({3}, DType::F32);
    try {
      c.all_gather(a, b);
      ADD_FAILURE() << "all_gather into a too small output did not throw";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("all_gather on world (rank"), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("output has 3 elements, expected 8"), std::string::npos) << e.what();
    }
    Tensor i = Tensor::zeros({8}, DType::I32);
    EXPECT_THROW(c.reduce_scatter(i, a), Error);  // i32 in, f32 out
    Tensor rows = Tensor::zeros({3, 2}, DType::F32), out = Tensor::zeros({3, 2}, DType::F32);
    try {
      c.all_to_all_v(rows, {2, 2}, out, {2, 2});
      ADD_FAILURE() << "send counts adding up to 4 for 3 rows did not throw";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("add up to"), std::string::npos) << e.what();
    }
    EXPECT_THROW(c.send(a, 5), Error);
    EXPECT_THROW(c.broadcast(a, -1), Error);
  });
}

// world 8 = pp 2 x dp 2 x ep 2: each sub-communicator holds exactly the mesh's group, in
// the mesh's order, and reduces over it alone.
TEST(CommGlooMesh, SubCommunicatorsFollowTheMesh) {
  const Mesh mesh(8, 2, -1, 1, 2);
  run_ranks(8, [&](Communicator& world) {
    // run_ranks owns the world communicator; MeshComms wants shared ownership of it.
    std::shared_ptr<Communicator> w(&world, [](Communicator*) {});
    MeshComms m = MeshComms::build(w, mesh);
    const int r = world.rank();
    struct Axis {
      std::shared_ptr<Communicator> comm;
      std::vector<int> group;
      const char* name;
    };
    const Axis axes[] = {{m.pp, mesh.group(r, {MeshAxis::PP}), "world/pp"},
                         {m.dp, mesh.group(r, {MeshAxis::DP}), "world/dp"},
                         {m.cp, mesh.group(r, {MeshAxis::CP}), "world/cp"},
                         {m.ep, mesh.group(r, {MeshAxis::EP}), "world/ep"},
                         {m.dp_cp, mesh.group(r, {MeshAxis::DP, MeshAxis::CP}), "world/dp_cp"},
                         {m.dp_cp_ep, mesh.group(r, {MeshAxis::DP, MeshAxis::CP, MeshAxis::EP}), "world/dp_cp_ep"}};
    for (const Axis& a : axes) {
      ASSERT_TRUE(a.comm) << a.name;
      EXPECT_EQ(a.comm->name(), a.name);
      ASSERT_EQ(a.comm->size(), static_cast<int>(a.group.size())) << a.name;
      EXPECT_EQ(a.group[a.comm->rank()], r) << a.name;
      Tensor mine = Tensor::from_vector<int64_t>({r}, {1});
      Tensor all = Tensor::empty({a.comm->size()}, DType::I64);
      a.comm->all_gather(mine, all);
      std::vector<int64_t> expected(a.group.begin(), a.group.end());
      EXPECT_EQ(all.to_vector<int64_t>(), expected) << a.name << " on rank " << r;
    }
    EXPECT_EQ(m.ep->size(), 2);
    EXPECT_EQ(m.cp->size(), 1);
    EXPECT_EQ(m.dp_cp_ep->size(), 4);
  });
}

// world 8 = dp 2 x tp 2 x ep 2, and again as HSDP (dp_replicate 2): the tensor-parallel
// groups (tp; tp x ep, an MoE layer's expert ranks; the stage's dp x cp x tp x ep, whose ranks
// all hold different tokens) follow the mesh; FSDP's groups keep tp fixed.
TEST(CommGlooMesh, TensorParallelGroupsFollowTheMesh) {
  const Mesh mesh(8, 1, -1, 1, 2, 2);
  for (int replicate : {1, 2}) {
    SCOPED_TRACE(replicate);
    run_ranks(8, [&](Communicator& world) {
      std::shared_ptr<Communicator> w(&world, [](Communicator*) {});
      MeshComms m = MeshComms::build(w, mesh, replicate);
      const int r = world.rank();
      std::vector<int> stage = mesh.group(r, {MeshAxis::DP, MeshAxis::CP, MeshAxis::TP, MeshAxis::EP});
      std::vector<int> dense = mesh.group(r, {MeshAxis::DP, MeshAxis::CP, MeshAxis::EP});
      if (replicate == 2) {  // inside the replica group: dp coordinate r / 4 is the replica here
        auto same_replica = [&](int o) { return mesh.coord(o).dp == mesh.coord(r).dp; };
        std::erase_if(stage, [&](int o) { return !same_replica(o); });
        std::erase_if(dense, [&](int o) { return !same_replica(o); });
      }
      const std::pair<std::shared_ptr<Communicator>, std::vector<int>> groups[] = {
          {m.tp, mesh.group(r, {MeshAxis::TP})},
          {m.tp_ep, mesh.group(r, {MeshAxis::TP, MeshAxis::EP})},
          {m.stage, stage},
          {m.shard_dense, dense}};
      for (const auto& [comm, group] : groups) {
        ASSERT_TRUE(comm);
        ASSERT_EQ(comm->size(), static_cast<int>(group.size())) << comm->name();
        Tensor mine = Tensor::from_vector<int64_t>({r}, {1});
        Tensor all = Tensor::empty({comm->size()}, DType::I64);
        comm->all_gather(mine, all);
        EXPECT_EQ(all.to_vector<int64_t>(), std::vector<int64_t>(group.begin(), group.end()))
            << comm->name() << " on rank " << r;
      }
    });
  }
}

TEST(CommGlooSplit, NegativeColorJoinsNoGroupAndKeysOrderTheRest) {
  run_ranks(4, [](Communicator& c) {
    // Ranks 0 and 2 drop out; 1 and 3 form a group ordered by key, so 3 comes first.
    const bool in = c.rank() % 2 == 1;
    auto sub = c.split(in ? 7 : -1, -c.rank(), "odd");
    if (!in) {
      EXPECT_EQ(sub, nullptr);
      return;
    }
    ASSERT_TRUE(sub);
    EXPECT_EQ(sub->size(), 2);
    EXPECT_EQ(sub->rank(), c.rank() == 3 ? 0 : 1);
    Tensor t = Tensor::from_vector<int32_t>({c.rank()}, {1});
    sub->all_reduce(t);
    EXPECT_EQ(t.item(), 4.0);
  });
}

// A peer that never joins is an Error naming it, within the timeout, not a hang.
TEST(CommGlooTimeouts, MissingPeerAtRendezvousIsNamed) {
  testing::TempDir dir;
  auto opt = test_options(std::chrono::seconds(1));
  auto start = std::chrono::steady_clock::now();
  try {
    auto store = Store::open(dir.str(), 0, opt.timeout);
    GlooCommunicator::connect(store, 0, 2, opt);
    ADD_FAILURE() << "connect without the second rank returned";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("rank 1 did not join"), std::string::npos) << e.what();
  }
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(6));
}

// Rank 1 is connected but never enters the all-reduce: rank 0 gets an Error naming the op
// once the timeout passes.
TEST(CommGlooTimeouts, PeerThatNeverEntersACollectiveTimesOut) {
  std::latch rank0_done(1);
  run_ranks(
      2,
      [&](Communicator& c) {
        if (c.rank() == 1) {
          rank0_done.wait();
          return;
        }
        Tensor t = Tensor::zeros({16}, DType::F32);
        auto start = std::chrono::steady_clock::now();
        try {
          c.all_reduce(t);
          ADD_FAILURE() << "all_reduce without rank 1 returned";
        } catch (const Error& e) {
          EXPECT_NE(std::string(e.what()).find("all_reduce on world (rank 0 of 2)"), std::string::npos) << e.what();
        }
        EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(5));
        rank0_done.count_down();
      },
      test_options(std::chrono::seconds(1)));
}

// Rank 1 goes away (its sockets close) while rank 0 waits in an all-reduce with a long
// timeout: rank 0 fails at once instead of waiting out the timeout.
TEST(CommGlooTimeouts, PeerThatDiesFailsTheCollectiveFast) {
  testing::TempDir dir;
  auto opt = test_options(std::chrono::seconds(60));
  std::string error;
  std::chrono::steady_clock::duration took{};
  std::latch connected(2);
  std::thread r1([&] {
    auto comm = GlooCommunicator::connect(Store::open(dir.str(), 1, opt.timeout), 1, 2, opt);
    connected.arrive_and_wait();
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
  });  // the communicator dies with the thread's scope
  {
    auto comm = GlooCommunicator::connect(Store::open(dir.str(), 0, opt.timeout), 0, 2, opt);
    connected.arrive_and_wait();
    Tensor t = Tensor::zeros({1 << 16}, DType::F32);
    auto start = std::chrono::steady_clock::now();
    try {
      comm->all_reduce(t);
    } catch (const Error& e) {
      error = e.what();
    }
    took = std::chrono::steady_clock::now() - start;
  }
  r1.join();
  EXPECT_NE(error.find("all_reduce on world (rank 0 of 2)"), std::string::npos) << error;
  EXPECT_LT(took, std::chrono::seconds(10)) << "a dead peer must not cost the whole timeout";
}

}  // namespace
}  // namespace moetrain
