// ElasticAgent: `moetrain launch` on one node of a job that spans many (TorchElastic's
// agent, our code). It meets the other nodes' agents at a rendezvous (comm/rendezvous.h),
// starts this node's workers with their global ranks, and watches them and the round:
//   - a worker of this node fails (exits non-zero, is killed, stops its heartbeat): the
//     agent stops the others and ends the round as a failure;
//   - the round ends elsewhere (another node's failure, a spare asking to scale up) or a
//     member node stops beating: the agent stops its workers;
// then it joins the next round, which forms from the agents that come (fewer nodes when
// some are gone for good, down to min_nodes), and starts the workers again: they resume
// from the newest committed checkpoint, resharded to the new world. After more than
// max_restarts failure rounds the job stops with the last failure's status.
//
// The workers see TORCHELASTIC_RESTART_COUNT (the round), TORCHELASTIC_RUN_ID, GROUP_RANK,
// and MOETRAIN_FAILURE_AT (seconds since the epoch of the failure that ended the previous
// round, so the trainer can report the time lost to it).
#pragma once

#include "comm/launcher.h"
#include "comm/rendezvous.h"

namespace moetrain {

struct ElasticConfig {
  RendezvousConfig rendezvous;
  int max_restarts = 0;  // failure rounds tolerated (scale-ups do not count)
  std::string local_addr;  // how the other nodes reach this one (default: the hostname)
};

// Runs the job's rounds on this node until it ends; returns the exit status (0: the job
// finished, or this node was a spare when it did). `workers` is the spec of this node's
// workers (nproc, argv, env, grace, heartbeat, ...); the agent fills the ranks and store.
int run_elastic_agent(const ElasticConfig& cfg, LaunchSpec workers);

}  // namespace moetrain
