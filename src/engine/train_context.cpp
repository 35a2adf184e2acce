#include "engine/train_context.h"

#include "engine/parallel/layout_choices.h"

#include <unistd.h>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "core/cuda_runtime.h"
#include "core/log.h"
#include "engine/parallel/all_gather_dispatch.h"
#include "engine/plan/memory_plan.h"

namespace moetrain {

TrainContext::StreamHolder::~StreamHolder() {
  if (!stream) return;
  try {
    cuda::stream_synchronize(stream);
    cuda::destroy_stream(stream);
  } catch (const std::exception& e) {
    spdlog::error("train context: releasing the communication stream: {}", e.what());
  }
}

std::unique_ptr<TrainContext> TrainContext::build(const RunConfig& cfg, ParallelContext par_in) {
  auto ctx = std::make_unique<TrainContext>();
  TrainContext& c = *ctx;
  const TrainingConfig& tc = cfg.training;
  c.par = std::move(par_in);
  const ParallelContext& par = c.par;
  const bool gpu = tc.device == "cuda";
  const Layout& layout = par.layout;
  ModelPlacement placement = layout.placement();
  if (gpu) {
    // The planner does not model tensor parallelism yet: under tp it plans the experts over the
    // tp x ep ranks and everything else whole (an upper bound), and does not refuse the run.
    if (layout.tp() > 1 && par.rank == 0) {
      spdlog::info("memory plan: tensor parallelism is not modelled; the plan below holds the attention, the head "
                   "and their activations whole (an upper bound)");
    }
    check_memory_at_start(cfg, layout.pp(), layout.shard_ranks(/*experts=*/true) / layout.cp(), layout.cp(),
                          layout.expert_ranks(), static_cast<double>(cuda::device_total_memory(par.device.index)),
                          par.rank == 0, tc.check_memory && layout.tp() == 1);
  }

  // Pipeline: the schedule of a training step and of a validation pass, the model cut into
  // its chunks, and this rank's share of them (pipeline/executor.h). Expert parallelism with
  // ep_overlap runs as a pipeline of one rank: DualPipeV's two chunks, whose overlapped
  // forward/backward pairs hide one micro-batch's exchange under another's compute (that
  // rank holds both chunks, the whole model as without a pipeline, so the choice can wait
  // for the model: "auto" needs its size).
  auto make_pipeline = [&] {
    const bool v = cfg.parallel.schedule == "dualpipev" || layout.pp() == 1;
    const int M = static_cast<int>(tc.grad_accum_steps);
    try {
      c.pipe_train = std::make_unique<PipelineSchedule>(v ? make_dualpipev(layout.pp(), M) : make_1f1b(layout.pp(), M));
      validate(*c.pipe_train);
    } catch (const Error& e) {
      MT_THROW("[parallel].schedule = \"{}\" with pp = {} and [training].grad_accum_steps = {} micro-batches: {}",
               cfg.parallel.schedule, layout.pp(), tc.grad_accum_steps, e.what());
    }
    c.pipe_val = std::make_unique<PipelineSchedule>(make_forward_only(layout.pp(), static_cast<int>(tc.eval_batches), v));
    c.chunks = partition_layers(cfg.model->shape().num_layers, c.pipe_train->num_chunks, cfg.model->shape().mtp_layers,
                                head_weight_in_layers(*cfg.model));
    // The head's rows partly on another rank where the layers cannot even out the head's rank.
    if (layout.pp() > 1 && layout.tp() == 1 && cfg.model->shape().mtp_layers == 0) {
      const HeadHelp help = choose_head_helper(c.chunks, *c.pipe_train, head_weight_in_layers(*cfg.model),
                                               cfg.parallel.head_share);
      if (help.share > 0) {
        add_head_helper(*c.pipe_train, help.helper, help.share, help.head_cost);
        spdlog::info("pipeline: rank {} computes the head of the last {:.0f}% of each micro-batch's token rows with a "
                     "copy of the head ([parallel].head_share = {})",
                     help.helper, 100.0 * help.share, cfg.parallel.head_share);
      }
    } else if (cfg.parallel.head_share > 0) {
      MT_THROW("[parallel].head_share = {}: a head helper needs pp > 1, tp = 1 and no multi-token prediction modules",
               cfg.parallel.head_share);
    }
    placement = pipeline_placement(c.chunks, *c.pipe_train, layout.pp_rank(), placement);
    std::string chunk_list;
    for (size_t i = 0; i < c.chunks.size(); ++i) {
      const ChunkSpec& s = c.chunks[i];
      chunk_list += fmt::format("{}{}:[{},{}){}", i ? " " : "", i, s.first_layer, s.last_layer,
                                s.embed ? "+embed" : s.head ? "+head" : "");
    }
    const ScheduleTimes t = simulate(*c.pipe_train, 1.0, 1.0, 1.0);
    spdlog::info("pipeline: {} over {} ranks, {} micro-batches per step; chunks (layers) {} (the head weighing {:.2f} "
                 "layers); bubble {:.1f}% at equal F/B/W times",
                 c.pipe_train->name, layout.pp(), tc.grad_accum_steps, chunk_list, head_weight_in_layers(*cfg.model),
                 100.0 * t.bubble_fraction);
  };
  if (layout.pp() > 1) make_pipeline();

  // Model, dispatcher, optimizer. On the GPU: bf16 weights and activations, f32 masters,
  // gradients and optimizer state. Many ranks: this rank's experts and layers, and the
  // optimizer state sharded over the data ranks (FsdpContext).
  c.model = build_model(*cfg.model, gpu ? DType::BF16 : DType::F32, par.device, placement);
  c.model->init_weights(static_cast<uint64_t>(tc.seed));
  if (layout.pp() == 1 && layout.expert_ranks() > 1 && choose_ep_overlap(cfg, *c.model, par.device)) {
    make_pipeline();
    const int64_t L = cfg.model->shape().num_layers + cfg.model->shape().mtp_layers;
    MT_CHECK(static_cast<int64_t>(placement.layers.size()) == L && placement.embed && placement.head,
             "ep_overlap: the one-rank pipeline must hold the whole model ({} of {} layers)", placement.layers.size(), L);
  }
  const bool pipelined = c.pipe_train != nullptr;
  c.model->set_expert_wgrad_group(tc.expert_wgrad_group);
  if (layout.expert_ranks() == 1) {
    c.dispatcher = std::make_unique<LocalDispatcher>();
  } else {
    // Tensor parallelism folds into expert parallelism: an MoE layer's experts are on the tp
    // x ep ranks, each sending its own sequence-parallel slice of the tokens.
    // On GPUs the exchanges run on their own stream and return before they finish; the model
    // waits where it uses a result (its chunk pieces), so DualPipeV's paired micro-batch
    // computes meanwhile.
    ExchangeOptions o;
    o.check_conservation = cfg.parallel.check_exchange;
    o.max_tokens = tc.micro_batch_size * tc.seq_len / layout.tp();  // every micro-batch is B x S, on every rank
    if (gpu) {
      c.comm_stream.stream = cuda::create_stream();
      c.comm_stream_backward.stream = cuda::create_stream();
      o.comm_stream = c.comm_stream.stream;
      o.comm_stream_backward = c.comm_stream_backward.stream;
      o.defer_wait = true;
      o.peer_copies = cfg.parallel.ep_transport == "auto";
    }
    const int64_t top_k = cfg.model->shape().experts_per_token;
    const bool gather = cfg.parallel.ep_dispatch == "all_gather" ||
                        (cfg.parallel.ep_dispatch == "auto" && layout.expert_ranks() < top_k);
    Communicator& expert_group = layout.folds_experts() ? *par.comms->tp_ep : *par.comms->ep;
    if (gather) {
      c.dispatcher = std::make_unique<AllGatherDispatcher>(expert_group, o);
    } else {
      c.dispatcher = std::make_unique<AllToAllDispatcher>(expert_group, o);
    }
    spdlog::info("parallel: experts over {} ranks{}, tokens moved by {} ([parallel].ep_dispatch = \"{}\", top-{} "
                 "routing)",
                 layout.expert_ranks(),
                 layout.tp() == 1             ? std::string()
                 : layout.folds_experts() ? fmt::format(" (tp {} x ep {})", layout.tp(), layout.ep())
                                          : fmt::format(" (ep; not folded: every tp rank holds them)"),
                 gather ? "all-gather / reduce-scatter" : "all-to-all", cfg.parallel.ep_dispatch, top_k);
  }
  c.model->set_detailed_telemetry(cfg.metrics.detailed);
  c.model->set_fp8(tc.fp8);
  if (layout.cp() > 1) c.model->set_context_group(par.comms->cp.get());
  if (layout.tp() > 1) c.model->set_tensor_group(par.tp_group());
  if (tc.recompute != "none") {
    std::vector<int64_t> layers;
    for (int64_t id = 0; id < cfg.model->shape().num_layers; ++id) {
      if (tc.recomputes(id)) layers.push_back(id);
    }
    const bool full = tc.recompute == "full";
    c.model->set_recompute(layers, full ? RecomputeMode::kFull : RecomputeMode::kSelective);
    spdlog::info("recompute: {}, decoder layers [{}] {}", tc.recompute, fmt::join(layers, ", "),
                 full ? "keep only their input and redo their forward before their backward"
                      : "drop their norm and rotary outputs (and local expert rows) and make them again before their "
                        "backward");
  }
  const OptimizerConfig& oc = cfg.optimizer;
  const AdamWConfig adamw{oc.beta1, oc.beta2, oc.eps, oc.weight_decay, oc.moments == "bf16"};
  if (par.comms) {  // several ranks, or a replica group of live fault tolerance
    c.model->set_data_group(par.data_group(), par.bridge.get());
    const bool shard_weights = choose_shard_weights(cfg.parallel.shard_weights, *c.model, par.device, pipelined);
    c.fsdp = std::make_unique<FsdpContext>(*c.model, *par.comms->shard_dense, *par.comms->shard_experts,
                                           *par.comms->replica_world, adamw, shard_weights, par.bridge.get(),
                                           par.tp_group());
    // Not with live fault tolerance: a group that heals writes weights and optimizer state
    // while another's updates could still run.
    if (oc.overlap && gpu && !cfg.fault_tolerance.enabled()) {
      const bool on = c.fsdp->set_overlap(true);
      spdlog::info("optimizer: {}", on ? "each layer's update and weight gather under the next forward, its gradients "
                                         "reduce-scattered as the last backward makes them ([optimizer].overlap)"
                                       : "in line after the step (the overlap takes whole weights, no tensor "
                                         "parallelism, no HSDP replica groups, NCCL)");
    }
    if (pipelined) c.pipeline = std::make_unique<PipelineExecutor>(*c.model, *c.dispatcher, par.pp_group(), c.chunks);
  } else {
    c.single_opt = std::make_unique<AdamW>(c.model->parameters(), adamw);
    const LayerwiseConfig lc{oc.overlap && gpu, static_cast<int>(oc.overlap_sms)};
    c.layerwise = std::make_unique<LayerwiseOptimizer>(*c.model, *c.single_opt, lc);
  }
  return ctx;
}

namespace {

// This rank's whole weights and f32 gradients (bytes), and the memory they are held against.
WholeWeightBytes whole_weights(Model& model, const Device& device, int64_t memory) {
  WholeWeightBytes w;
  for (const Parameter& p : model.parameters()) w.bytes += static_cast<double>(p.value.nbytes() + 4 * p.value.numel());
  w.memory = static_cast<double>(
      memory > 0 ? memory
      : device.is_cpu() ? static_cast<int64_t>(::sysconf(_SC_PHYS_PAGES)) * ::sysconf(_SC_PAGE_SIZE)
                        : cuda::device_total_memory(device.index));
  return w;
}

}  // namespace

bool choose_ep_overlap(const RunConfig& cfg, Model& model, const Device& device, int64_t memory) {
  const LayoutChoice c = decide_ep_overlap(cfg, whole_weights(model, device, memory));
  if (cfg.parallel.ep_overlap == "auto") spdlog::info("parallel: {}", c.why);
  return c.on;
}

bool choose_shard_weights(const std::string& setting, Model& model, const Device& device, bool pipelined,
                          int64_t memory) {
  const LayoutChoice c = decide_shard_weights(setting, pipelined, whole_weights(model, device, memory));
  if (setting == "auto" || (pipelined && setting == "true")) spdlog::info("parallel: {}", c.why);
  return c.on;
}

StepResult TrainContext::step(const std::vector<Batch>& batches, double lr, double grad_clip, const CommitFn& commit) {
  StepResult r;
  if (pipeline) {
    r = train_step(*pipeline, *pipe_train, *model, *fsdp, *par.data_group(), *par.comms->replica_world, batches, lr,
                   grad_clip, commit);
  } else if (fsdp) {
    r = train_step(*model, *dispatcher, *fsdp, *par.data_group(), batches, lr, grad_clip, commit);
  } else {
    r = train_step(*model, *dispatcher, *layerwise, batches, lr, grad_clip, commit);
  }
  if (r.committed) model->balance_experts(r.expert_counts);  // the loads are every data rank's: all move alike
  return r;
}

}  // namespace moetrain
