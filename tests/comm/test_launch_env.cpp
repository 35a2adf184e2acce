// LaunchEnv: the variables of torchrun, SLURM and OpenMPI, and bad values named.
#include <gtest/gtest.h>

#include <cstdlib>
#include <map>

#include "comm/launch_env.h"
#include "comm/store.h"
#include "core/error.h"

namespace moetrain {
namespace {

using Vars = std::map<std::string, std::string>;

LaunchEnv parse(const Vars& vars) {
  return LaunchEnv::parse([&](const std::string& k) -> std::optional<std::string> {
    auto it = vars.find(k);
    if (it == vars.end()) return std::nullopt;
    return it->second;
  });
}

std::string error_of(const Vars& vars) {
  try {
    parse(vars);
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

TEST(CommLaunchEnv, NoLauncherIsOneProcess) {
  LaunchEnv e = parse({});
  EXPECT_EQ(e.launcher, "none");
  EXPECT_EQ(e.rank, 0);
  EXPECT_EQ(e.world_size, 1);
  EXPECT_EQ(e.local_world_size, 1);
  EXPECT_TRUE(e.single_node());
  EXPECT_EQ(default_store_spec(e), "memory");
}

TEST(CommLaunchEnv, Torchrun) {
  LaunchEnv e = parse({{"RANK", "5"},
                       {"WORLD_SIZE", "8"},
                       {"LOCAL_RANK", "1"},
                       {"LOCAL_WORLD_SIZE", "4"},
                       {"MASTER_ADDR", "node7"},
                       {"MASTER_PORT", "29500"},
                       {"TORCHELASTIC_RUN_ID", "job/42"},
                       {"TORCHELASTIC_RESTART_COUNT", "2"}});
  EXPECT_EQ(e.launcher, "torchrun");
  EXPECT_EQ(e.rank, 5);
  EXPECT_EQ(e.world_size, 8);
  EXPECT_EQ(e.local_rank, 1);
  EXPECT_EQ(e.local_world_size, 4);
  EXPECT_FALSE(e.single_node());
  EXPECT_EQ(e.master_addr, "node7");
  EXPECT_EQ(e.master_port, 29500);
  EXPECT_EQ(e.run_id, "torchrun-job_42-2-29500");
  // torchrun's agent holds MASTER_PORT with its own store: ours takes the next port.
  EXPECT_EQ(default_store_spec(e), "tcp://node7:29501");
}

TEST(CommLaunchEnv, OpenMpi) {
  LaunchEnv e = parse({{"OMPI_COMM_WORLD_RANK", "3"},
                       {"OMPI_COMM_WORLD_SIZE", "4"},
                       {"OMPI_COMM_WORLD_LOCAL_RANK", "3"},
                       {"OMPI_COMM_WORLD_LOCAL_SIZE", "4"}});
  EXPECT_EQ(e.launcher, "openmpi");
  EXPECT_EQ(e.rank, 3);
  EXPECT_EQ(e.world_size, 4);
  EXPECT_EQ(e.local_rank, 3);
  EXPECT_TRUE(e.single_node());
  // One machine and no MASTER_ADDR: a file store named after the run.
  EXPECT_NE(default_store_spec(e).find("moetrain-store-openmpi"), std::string::npos);
}

TEST(CommLaunchEnv, Slurm) {
  LaunchEnv e = parse({{"SLURM_PROCID", "9"},
                       {"SLURM_NTASKS", "11"},
                       {"SLURM_LOCALID", "1"},
                       {"SLURM_NODEID", "2"},
                       {"SLURM_TASKS_PER_NODE", "4(x2),3"},
                       {"SLURM_JOB_NODELIST", "gpu[03-05,9],cpu1"},
                       {"SLURM_JOB_ID", "123456"},
                       {"SLURM_STEP_ID", "0"}});
  EXPECT_EQ(e.launcher, "slurm");
  EXPECT_EQ(e.rank, 9);
  EXPECT_EQ(e.world_size, 11);
  EXPECT_EQ(e.local_rank, 1);
  EXPECT_EQ(e.local_world_size, 3);  // the third node runs 3 tasks
  EXPECT_EQ(e.master_addr, "gpu03");
  EXPECT_EQ(e.master_port, 10000 + 123456 % 20000);
  EXPECT_EQ(default_store_spec(e), "tcp://gpu03:" + std::to_string(10000 + 123456 % 20000));

  LaunchEnv f = parse({{"SLURM_PROCID", "2"},
                       {"SLURM_NTASKS", "4"},
                       {"SLURM_LOCALID", "0"},
                       {"SLURM_NTASKS_PER_NODE", "2"},
                       {"MASTER_ADDR", "10.0.0.1"},
                       {"MASTER_PORT", "4000"}});
  EXPECT_EQ(f.local_world_size, 2);
  EXPECT_EQ(f.master_addr, "10.0.0.1");
  EXPECT_EQ(f.master_port, 4000);
}

TEST(CommLaunchEnv, TorchrunInsideASlurmAllocationWins) {
  LaunchEnv e = parse({{"RANK", "1"}, {"WORLD_SIZE", "2"}, {"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "1"}});
  EXPECT_EQ(e.launcher, "torchrun");
  EXPECT_EQ(e.rank, 1);
}

TEST(CommLaunchEnv, BadValuesNameTheVariable) {
  EXPECT_NE(error_of({{"RANK", "1"}}).find("RANK is set but WORLD_SIZE is not"), std::string::npos);
  EXPECT_NE(error_of({{"RANK", "abc"}, {"WORLD_SIZE", "2"}}).find("RANK='abc' is not an integer"),
            std::string::npos);
  EXPECT_NE(error_of({{"RANK", "2"}, {"WORLD_SIZE", "2"}}).find("RANK=2 is not below WORLD_SIZE=2"),
            std::string::npos);
  EXPECT_NE(error_of({{"RANK", "0"}, {"WORLD_SIZE", "0"}}).find("WORLD_SIZE=0 is out of range"), std::string::npos);
  EXPECT_NE(error_of({{"RANK", "0"}, {"WORLD_SIZE", "4"}, {"LOCAL_RANK", "2"}, {"LOCAL_WORLD_SIZE", "2"}})
                .find("LOCAL_RANK=2 is not below LOCAL_WORLD_SIZE=2"),
            std::string::npos);
  EXPECT_NE(error_of({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_PORT", "70000"}}).find("MASTER_PORT=70000"),
            std::string::npos);
  EXPECT_NE(error_of({{"OMPI_COMM_WORLD_RANK", "0"}}).find("OMPI_COMM_WORLD_SIZE is not"), std::string::npos);
  EXPECT_NE(error_of({{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "4"}, {"SLURM_TASKS_PER_NODE", "2(x2"}})
                .find("SLURM_TASKS_PER_NODE"),
            std::string::npos);
  EXPECT_NE(error_of({{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "2"}, {"SLURM_JOB_NODELIST", "gpu[01-02"}})
                .find("SLURM_JOB_NODELIST"),
            std::string::npos);
}

TEST(CommLaunchEnv, SlurmNodeLists) {
  EXPECT_EQ(first_slurm_host("node1"), "node1");
  EXPECT_EQ(first_slurm_host("node1,node2"), "node1");
  EXPECT_EQ(first_slurm_host("nid00[1-3]"), "nid001");
  EXPECT_EQ(first_slurm_host("a[7,9]-ib,b1"), "a7-ib");
  EXPECT_EQ(slurm_tasks_on_node("8", 0, "X"), 8);
  EXPECT_EQ(slurm_tasks_on_node("2(x3),1", 2, "X"), 2);
  EXPECT_EQ(slurm_tasks_on_node("2(x3),1", 3, "X"), 1);
  EXPECT_THROW(slurm_tasks_on_node("2(x3),1", 4, "X"), Error);
}

TEST(CommLaunchEnv, SeveralMachinesWithoutAStoreIsAnError) {
  LaunchEnv e = parse({{"OMPI_COMM_WORLD_RANK", "0"},
                       {"OMPI_COMM_WORLD_SIZE", "8"},
                       {"OMPI_COMM_WORLD_LOCAL_RANK", "0"},
                       {"OMPI_COMM_WORLD_LOCAL_SIZE", "4"}});
  try {
    default_store_spec(e);
    ADD_FAILURE() << "no store for a job over two machines did not throw";
  } catch (const Error& err) {
    EXPECT_NE(std::string(err.what()).find("MOETRAIN_STORE"), std::string::npos) << err.what();
  }
  e.store = "redis://cache:6379";
  EXPECT_EQ(default_store_spec(e), "redis://cache:6379");
}

// The real process environment, set and unset here.
TEST(CommLaunchEnv, ReadsTheProcessEnvironment) {
  for (const char* v : {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                        "MOETRAIN_STORE", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "SLURM_PROCID",
                        "SLURM_NTASKS"}) {
    ::unsetenv(v);
  }
  EXPECT_EQ(LaunchEnv::from_environment().launcher, "none");
  ::setenv("RANK", "2", 1);
  ::setenv("WORLD_SIZE", "3", 1);
  ::setenv("MOETRAIN_STORE", "/tmp/somewhere", 1);
  LaunchEnv e = LaunchEnv::from_environment();
  ::unsetenv("RANK");
  ::unsetenv("WORLD_SIZE");
  ::unsetenv("MOETRAIN_STORE");
  EXPECT_EQ(e.launcher, "torchrun");
  EXPECT_EQ(e.rank, 2);
  EXPECT_EQ(e.world_size, 3);
  EXPECT_EQ(e.local_rank, 2);
  EXPECT_EQ(e.local_world_size, 3);
  EXPECT_EQ(default_store_spec(e), "/tmp/somewhere");
}

}  // namespace
}  // namespace moetrain
