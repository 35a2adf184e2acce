// Fault injection for the chaos tests: named points in the engine where a fault that the
// environment variable MOETRAIN_FAULT names fires. When the variable is unset a point costs
// one test of a flag read once.
//
//   MOETRAIN_FAULT="ACTION@POINT[:rank=R][:step=S][:from_step=S][:generation=G]" (several: ';'-separated)
//     ACTION  kill (SIGKILL to itself: no cleanup, as a machine failure), kill_node (SIGKILL
//             to its launcher, then to itself: the launcher's other workers die with it, a
//             node lost for good), exit (status 3),
//             stall=SECONDS (sleeps there), term (SIGTERM to itself: a preemption notice),
//             error (fault_point returns true: the caller fails as that point's storage
//             would: `write` with ENOSPC, `s3` with HTTP 503)
//     POINT   step_begin (before a step's batches; step = the step about to run, 1-based),
//             save (before a checkpoint's snapshot; step = the step saved),
//             files, index, rename, latest (the commit of a step, in that order: this
//             rank's files written; rank 0: the index written, the directory renamed, the
//             `latest` pointer moved; the points of MOETRAIN_CHECKPOINT_CRASH too),
//             write (a rank's writer, before its files of the step),
//             upload (rank 0's uploader to the remote tier, before it mirrors the step),
//             s3 (every try of an S3 request; no step: a step filter never matches it),
//             micro_batch (after each micro-batch's forward and backward; no step),
//             live fault tolerance (ft/replica_manager.h): ft_quorum (rank 0, the lighthouse's
//             answer received, before the group has it), ft_step (after the quorum and any
//             healing, before the batches), ft_heal_send (a group sending its state to one
//             behind, some tensors posted), ft_allreduce (every gradient all-reduce across
//             replica groups; no step), ft_commit (before the vote on the step)
//     from_step=S: fire only at step S or later (a point without a step never matches it).
//     rank, step, generation: fire only there (RANK, the step, TORCHELASTIC_RESTART_COUNT as
//             `moetrain launch --max-restarts` sets it); omitted: everywhere.
//     count=N: fire only the first N times the point matches in this process.
//     skip=N: pass over the first N matches in this process (`kill@s3:rank=0:skip=12`: the
//             13th S3 request of rank 0, in the middle of some step's upload).
//
// A malformed value is an error naming it, at the first point reached.
#pragma once

#include <cstdint>
#include <string_view>

namespace moetrain {

// Fires the faults named for this point; returns whether one of them was `error`.
bool fault_point(std::string_view point, int64_t step);

}  // namespace moetrain
