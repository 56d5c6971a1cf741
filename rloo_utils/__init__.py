"""The plumbing and the seams of rloo.py, rloo_vllm.py and rloo_multigpu.py, one module per concern; nothing here knows
which script calls it: a script passes in what differs (its options, what a resume may change, how its model's weights
are written). The loss, the KL, the estimators and their advantages are the scripts' own. What the loop takes from here
by name: the default log-probs (packing) and the samplers (rollouts; vllm_sampling and sharded_sampling), the two a
reader of one update reads beside rloo.py (docs/algorithm.md); the task's score and its shaping, the group std
(rewards); dynamic sampling's refill (rollouts); the off-policy correction (off_policy); the optimizer step's guard
against non-finite values (models); an update's statistics (logs).

    errors         UsageError and RunError: one line each
    options        a script's groups of options in sections of --help (parse_args); what a resume may change; each
                   group's derived defaults
    checks         what every option must be, then each group's own check(), before anything expensive (check_args)
    json_options   options given as a JSON object (TRL's dict options)
    paths          a path option: a local path or a hub id
    schedules      the learning-rate schedule's options (ScheduleOptions): checked; warm-up, then transformers'
    data           prompt datasets, text and images; a batch's prompts, each repeated G times
    models         policy, reward model, tokenizers; precision; the options of the policy and of speed; the optimizer
                   step, skipped where the loss or the gradient is not finite
    generation     HF generate's side: the sampling options, generation configs, static cache; prompts tokenized
    gguf_cache     a .gguf policy's de-quantised copy, kept between runs (start-up in a few seconds, not ~20)
    rewards        reward functions: loaded, called, checked; the task's score of a completion
    scoring        the Scorer of a rollout: a reward model's forward, the functions called, what they log
    verifiable     reward functions of tasks with a right answer: the final answer parsed and checked; math answers
                   judged as math (accuracy_reward), the format of a boxed answer
    math_judge     math-verify in worker processes of their own, each answer bounded in time (accuracy_reward's judge)
    code_reward    the built-in code_reward: a completion's program run against its row's tests (open-r1's and MBPP's
                   schemas), the share passed
    sandbox        where each test run goes: bubblewrap's namespaces, rlimits and a clean environment, a pool of them
    tools          multi-turn rollouts: tools and environments, the chat template's tool calls
    vision         a vision-language policy's inputs
    decoding       our own decoding loop on a static KV cache (--decoding_loop own): stop tokens read every few steps
    off_policy     a sampler that is not the policy (vLLM, a bfloat16 copy): the copy, the correction's options, the gap
    packing        padding-free forwards; the log-probs from the output layer's inputs, a chunk at a time (fused)
    lora           LoRA adapters (peft)
    logs           metrics.jsonl, tables, TensorBoard, W&B; the progress bar; an update's statistics and metrics
    evaluation     the held-out evaluation and sample tables (Evaluator): when, its own random streams, pass@k
    processes      torch.distributed's group and the collectives the scripts need; one process is a group of one
    checkpoints    checkpoint files: written whole, found, checked and loaded (exact resume); the trained model saved
    lifecycle      a run's life: folders claimed and locked, signals, one-line errors, a failed run's rescue (RunGuard)
    set_up         a run's set-up: its plan (batch sizes, resume point, data, rewards, evaluation) and its models
    sharded        FSDP2: sharding, sharded loading and saving, a sharded reward model's Scorer (rloo_multigpu.py)
    sharded_sampling  rloo_multigpu.py's sampler: HF generate on the shards, or a vLLM server
    vLLM generation (rloo_vllm.py; rloo_multigpu.py with a server):
      vllm_options     its options and their checks
      vllm_sampling    what it samples on either engine: sampling parameters, seeds, outputs; the engine check;
                       rloo_vllm.py's sampler (VLLMSampler)
      vllm_colocated   an engine in this process
      vllm_server      a server's client: HTTP requests, its checks, the weight pushes
      weight_transfer  the policy's weights on their way to an engine (weights_for_vllm): NCCL, or shared memory
    rollouts       a Rollout, the sampling the scripts share (BaseSampler), rloo.py's sampler (HFSampler: HF
                   generate), dynamic sampling (DAPO), the whole batch of every process (gather_rollout)
    rollout_queue  asynchronous rollouts: the queue of rollouts generated while the trainer updates

rloo.py imports neither sharded nor the vLLM modules (tests/test_scripts_in_step.py holds that).
"""
