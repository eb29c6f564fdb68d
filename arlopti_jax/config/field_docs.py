"""What each config field means: the one source for ``--help`` and docs/reference/config.md's
table (``tests/config/test_cli.py`` checks that every field of ``base_config()`` has an entry and
that the table is this one)."""

FIELD_DOCS = {
    "run_dir": "run folder: TensorBoard events, `metrics.jsonl`, `eval.jsonl`, `checkpoints/`, `export/`",
    "seed": "sampling RNG seed",
    "resume": "`auto`: continue from the newest good checkpoint in `run_dir`; `none`: refuse if checkpoints "
              "exist; or a checkpoint step folder",
    "compile_cache_dir": "JAX's persistent compilation cache: compiled programs are saved here and reused by later "
                         "runs, resumes and evaluations (per user: they depend on the model, not the run; a folder "
                         "all hosts share lets every host reuse them, e.g. `gs://bucket/jax_cache` with gcsfs "
                         "installed); beyond 4 GiB the least recently used programs are deleted when a command starts; "
                         "`\"\"` = off",
    "model.path": "local Hugging Face folder (config.json, tokenizer, safetensors, optional "
                  "generation_config.json), or a Hub id `ORG/NAME[@REVISION]` read through the Hugging Face "
                  "cache (`HF_HOME`, `HF_HUB_OFFLINE`); `\"\"` = the embedded start point",
    "model.dtype": "activation dtype (`float32`, `bfloat16`); log-probs and losses are float32",
    "model.param_dtype": "weight dtype, and so the AdamW state's",
    "model.remat": "rematerialise each layer in the backward pass",
    "model.attention": "training and prefill attention: 'auto' (cuDNN's fused kernel on a GPU with a 16-bit "
                       "model.dtype and heads of at most 128, else XLA), 'xla', or 'cudnn' (GPU, 16-bit only; not "
                       "Gemma 3's heads of 256 nor soft-capped attention scores)",
    "model.decode_attention": "the sampler's attention in each decode step: 'auto' (on a GPU the Pallas kernel of "
                              "models/decode_attention.py, which writes the KV cache and reads only each row's "
                              "live slots; elsewhere, and for soft-capped attention scores, XLA's), 'xla', or "
                              "'pallas' (GPU only)",
    "model.decode_matmul": "the weight products of each decode step that runs the Pallas attention: 'xla', or "
                           "'pallas' (GPU only: models/decode_matmul.py's kernels, each with the RMS norm before it "
                           "and the residual add or silu x up after it, 6 kernels a layer; on an H200 the 1.5B rollout "
                           "ran 0.71x as fast as with XLA's, 2026-11-28; not Gemma 3)",
    "model.unroll_layers": "layers as straight-line code instead of a scanned loop in the training passes: faster "
                           "small models on CPU, longer compiles (the sampler always loops: rollout/programs.py); "
                           "on a GPU or TPU scan against unroll is not yet measured (the embedded default unrolls its "
                           "4 layers there too, by the compiler's figures: embedded/default.py)",
    "model.lora_rank": "LoRA: train rank-r adapters beside the frozen base weights (the reference policy is the base, "
                       "adapters off; AdamW state covers the adapters alone); 0 = full fine-tuning",
    "model.lora_alpha": "LoRA: each adapted weight is W + (lora_alpha / lora_rank) B A",
    "model.lora_targets": "LoRA: the projections that get adapters, comma-separated from q, k, v, o, gate, up, down",
    "model.logprob_chunk": "targets per packed row in each vocabulary-projection chunk (no [B, T, V] tensor is held; "
                           "up to 64 MiB of target logits per device are projected in one piece)",
    "data.train_files": "comma-separated parquet/jsonl files or folders, or Hugging Face Hub datasets "
                        "`ORG/NAME[@REVISION][[:CONFIG]:SPLIT]` (split `train` by default) read through the "
                        "`datasets` cache (`HF_DATASETS_CACHE`; `HF_DATASETS_OFFLINE`, else `HF_HUB_OFFLINE`; a "
                        "dataset only in the Hub cache is read from its snapshot); parquet, json and arrow data only, "
                        "no Hub code runs; a path that exists here is a path",
    "data.test_files": "the same, for evaluation (a Hub dataset's split: `test` by default); each test file or Hub "
                       "split is reported separately",
    "data.prompt_key": "the prompt's column: a string, or chat messages (a list of {role, content}); a list ending "
                       "with the assistant's message (TRL's `messages`) is the conversation before it; a string is "
                       "tokenized as it is unless `prompt_style` is `messages`",
    "data.answer_key": "the ground truth's column, handed to the reward (dotted names reach into nested columns: "
                       "verl's `reward_model.ground_truth`); the same name as `prompt_key`: the content of the "
                       "assistant's message that ends the prompt's conversation",
    "data.data_source": "the `data_source` of rows that have none (it picks the built-in reward, and groups `acc/*` "
                        "and the evaluation); `\"\"` = every row must have the column",
    "data.prompt_style": "`template`: the prompt text already holds the chat template (public K&K files); "
                         "`messages`: apply the tokenizer's chat template; `auto`: decide per row",
    "data.max_prompt_length": "longer prompts are dropped, and the drop is reported per file",
    "data.shuffle_seed": "data order (reshuffled each epoch with seed + epoch; the last partial batch is dropped)",
    "rollout.n": "responses per prompt (the group size G)",
    "rollout.temperature": "sampling temperature; pi_old is the temperature-scaled full distribution",
    "rollout.top_p": "nucleus sampling (1 = off)",
    "rollout.top_k": "top-k sampling (0 = off)",
    "rollout.max_response_length": "response tokens, EOS included",
    "rollout.stop": "strings that end a response, as vLLM's `stop`: matched on the decoded text (special tokens "
                    "kept), so one may end inside a token or span several; the response keeps the tokens up to the "
                    "one that completes the first stop string met, and the loss, the length and the rewards see "
                    "nothing after it (the sampler decodes on to EOS or max_response_length; the host trims). "
                    "A tuple: `--config.rollout.stop=\"('</answer>',)\"`; `()` = none",
    "rollout.include_stop_str": "the text given to the rewards keeps the stop string (vLLM's "
                                "`include_stop_str_in_output`); False = it ends just before it. The stop string's "
                                "last token is in the response (and the loss) either way",
    "rollout.prompt_bucket": "prompts are padded to min(next power of 2, next multiple of this) of the longest prompt "
                             "in the run's data: one prompt width per run",
    "rollout.recompute_old_logprobs": "take pi_old from the trainer's teacher-forced pass instead of the sampler's "
                                      "log-probs; always so where they can differ: max_staleness >= 1, the sampler "
                                      "on devices of its own, or reading weights in another dtype than the trainer's "
                                      "(rl/update.py); then `offpolicy/*` records the gap",
    "rollout.length_aware": "decode cost follows the responses' real lengths: the KV cache grows in phases and "
                            "finished rows are dropped from the batch; False = every step over all slots and rows "
                            "(the same tokens and log-probs)",
    "rollout.phase_tokens": "response slots of the first decode phase, doubling each phase up to "
                            "max_response_length; 0 = max_response_length / 4 rounded up to a power of two (three "
                            "phases; each phase is one more compiled decode loop per row count)",
    "rollout.min_rows": "rows per device below which the decode batch is not compacted further (each row count "
                        "is one more compiled program)",
    "rollout.whole_weights": "the sampler's copy of the weights whole along the mesh's data and fsdp axes (split "
                             "over tensor still), so no decode step gathers them: 'auto' (on a GPU or TPU, where "
                             "fsdp or data splits the weights and the copy takes at most an eighth of a device's "
                             "memory), 'on', 'off'",
    "rollout.max_staleness": "k, the policy versions the sampler may run ahead of the update: step t's update "
                             "consumes the batch sampled by the policy of step t - k (batch b by version "
                             "max(0, b - k): the initial policy samples batches 0 to k), pi_old recomputed by the "
                             "trainer at step t; the sampler waits, never drops a batch, and each batch's version is "
                             "checked (`sampler/version`, `sampler/lag`). At step t the sampler's programs for batch "
                             "t + k are dispatched in turns with the update's (rl/pipeline.py), one thread, the same "
                             "order on every process: with `rollout.devices` the two compute at once, colocated the "
                             "host's work (scoring, packing) overlaps the devices'; a checkpoint holds the k versions "
                             "that sample the batches in flight; 0 = on-policy",
    "rollout.correction": "the gap between pi_old and the behaviour policy (the sampler's log-probs), on the "
                          "policy-gradient term alone: `none`, `tis` (each token's weight min(pi_old / pi_behaviour, "
                          "tis_cap)) or `seq_mask` (a response whose geometric-mean ratio leaves [1/seq_mask_bound, "
                          "seq_mask_bound] gets weight 0); needs max_staleness >= 1 or recompute_old_logprobs "
                          "(algos/off_policy.py)",
    "rollout.devices": "the sampler's own devices: 0 = it shares the trainer's mesh (colocated); N = each "
                       "process's last N / processes devices sample (N a multiple of the process count, each process "
                       "keeping at least one for the trainer), on the mesh `rollout.mesh`, while the trainer's mesh "
                       "(`mesh.*`) holds the rest; every update's parameters are copied to the sampler's mesh (with "
                       "LoRA the adapters alone) and checked there (checksums on both sides). With max_staleness >= 1 "
                       "the sampler's and the trainer's devices compute at once, on one process or many "
                       "(rl/pipeline.py); at 0 they take turns",
    "rollout.hosts": "sampler hosts of their own: of P processes the last N sample on all their devices and the "
                     "first P - N train on theirs (N = P / 2: JAX moves arrays across processes between meshes of one "
                     "shape, so the sampler's mesh mirrors the trainer's `mesh.*`); every step the weights cross by "
                     "cross-process device_put (checked by checksums), the batch back; with max_staleness >= 1 the "
                     "two sides compute at once (rl/hosts.py); 0 = the sampler shares the trainer's hosts",
    "rollout.mesh.data": "the sampler's mesh (rollout.devices > 0): data-parallel axis size (-1 = the rest)",
    "rollout.mesh.fsdp": "the sampler's mesh: fsdp axis size (-1 = the rest)",
    "rollout.mesh.tensor": "the sampler's mesh: tensor-parallel axis size (-1 = the rest)",
    "rollout.max_kl": "the run stops with one error line where the sampler's log-probs of a batch are farther "
                      "than this from the trainer's pi_old (`offpolicy/kl_k3`, the k3 estimate per token, logged "
                      "wherever pi_old is the trainer's): a sampler that decodes wrong or lacks the weights shows "
                      "there first (a corrupted CPU decode measured 3.4; SmolLM2 one step stale, 0.004 at most). "
                      "0 = no bound",
    "rollout.tis_cap": "`tis`: C, the cap on a token's importance weight pi_old / pi_behaviour (verl's "
                       "`rollout_is_threshold`, 2 by default there too)",
    "rollout.seq_mask_bound": "`seq_mask`: B, a response is kept while exp(mean over its tokens of log pi_old - log "
                              "pi_behaviour) is within [1/B, B] (SkyRL's geometric mask, [0.99, 1.01] in its fully "
                              "asynchronous example)",
    "algo.adv_estimator": "`grpo`, `reinforce_plus_plus`, `rloo`, `dr_grpo`",
    "algo.weighting": "token weights: `none`, `ar` (Advantage Reweighting), `tr` (TR-GRPO)",
    "algo.ar_alpha": "AR alpha (paper: 0.2 alone, 0.3 with Lopti)",
    "algo.tr_scale": "TR-GRPO a in w = clip(a (sigmoid(p / tau) - mu), min, max); TR constants are this "
                     "project's choice (reasons in `algos/token_weights.py`)",
    "algo.tr_tau": "TR-GRPO tau",
    "algo.tr_mu": "TR-GRPO mu",
    "algo.tr_min": "TR-GRPO lower clip of the weight",
    "algo.tr_max": "TR-GRPO upper clip of the weight",
    "algo.lopti_eta": "Lopti threshold on pi_old: 0 = off, > 0 low pass first, < 0 high pass first "
                      "(paper: 0.4 alone, 0.5 with AR)",
    "algo.lopti_split": "`threshold`, or `quantile` (threshold = the |eta|-quantile of the batch's pi_old)",
    "algo.entropy_top_fraction": "the \"80/20\" rule (arXiv 2506.01939): the policy gradient only on this fraction "
                                 "of the rollout batch's response tokens with the highest pi_old entropy (a "
                                 "teacher-forced pass before the update; threshold: the batch's (1 - fraction)-"
                                 "quantile; the rest keep A = 0 and their place in the denominator); 0 = off; the "
                                 "paper: 0.2",
    "algo.filter_groups": "DAPO dynamic sampling: drop groups whose rewards are all equal (zero advantage) and "
                          "sample more prompts until `train.batch_prompts` groups remain",
    "algo.max_sample_rounds": "with `filter_groups`, at most this many generation rounds per step; if the "
                              "batch is still short, dropped groups fill it (logged)",
    "algo.overlong_buffer": "DAPO soft overlong penalty: L_c tokens; a response of L tokens gets "
                            "overlong_penalty x min(0, (max_response_length - L_c - L) / L_c) added "
                            "to its reward; 0 = off",
    "algo.overlong_penalty": "the overlong penalty's factor (its value at max_response_length)",
    "loss.clip_low": "PPO clip range below 1",
    "loss.clip_high": "PPO clip range above 1 (clip-higher)",
    "loss.dual_clip": "dual clip applied where A < 0",
    "loss.kl_coef": "KL to the frozen initial policy; 0 disables it, along with the reference policy",
    "loss.kl_type": "KL estimator: `k1`, `k2`, `k3`/`low_var_kl`",
    "loss.entropy_coef": "entropy bonus",
    "loss.agg": "`token-mean`, `seq-mean-token-mean`, `seq-mean-token-sum`",
    "loss.mode": "`ppo` (the clipped surrogate) or `cispo` (MiniMax-M1, arXiv 2506.13585: -sg[min(ratio, "
                 "`cispo_max_weight`)] x A x log pi on every token; the clip ranges and dual clip are unused)",
    "loss.ratio_level": "`token` (PPO's per-token ratio) or `sequence` (GSPO, arXiv 2507.18071: every token of a "
                        "response takes its sequence's ratio exp(mean log-ratio), clipped by `clip_low`/`clip_high`, "
                        "in GSPO-token's stop-gradient form; the paper's gradient with `agg` = `seq-mean-token-mean` "
                        "and its clip 3e-4/4e-4); `ppo` mode only",
    "loss.cispo_max_weight": "CISPO's upper bound on the importance weight, 1 + eps_high^IS (no lower bound, as "
                             "the paper); default: ScaleRL's 5",
    "optim.lr": "AdamW learning rate",
    "optim.b1": "AdamW beta1",
    "optim.b2": "AdamW beta2",
    "optim.weight_decay": "AdamW weight decay (every parameter)",
    "optim.eps": "AdamW epsilon",
    "optim.grad_clip": "global gradient-norm clip",
    "optim.schedule": "`constant` or `warmup_cosine` (counted in optimizer steps)",
    "optim.warmup_steps": "linear warm-up, in optimizer steps",
    "optim.min_lr_ratio": "`warmup_cosine` decays to lr x this",
    "train.batch_prompts": "prompts per RL step (verl's `data.train_batch_size`; TRL's `generation_batch_size` "
                           "counts completions: this x `rollout.n`)",
    "train.mini_batch": "responses per optimizer step (Lopti doubles the steps, `ppo_epochs` multiplies them); "
                        "verl's `ppo_mini_batch_size` and tunix's `mini_batch_size` count prompts, so this = theirs "
                        "x `rollout.n`; TRL's `per_device_train_batch_size` x processes x "
                        "`gradient_accumulation_steps` counts completions, as this does (docs/reference/peers.md)",
    "train.ppo_epochs": "updates over each rollout batch (the GRPO paper's mu; verl's `ppo_epochs`, TRL's and "
                        "tunix's `num_iterations`): every epoch runs each pass (Lopti's low then high) over all "
                        "the mini-batches, the same ones in the same order each epoch, so the optimizer steps per "
                        "RL step and the schedule's count are multiplied by it; pi_old stays the sampling "
                        "policy's (never recomputed between epochs) and the PPO clip bounds how far later epochs "
                        "move from it; `update/epochK/...` logs each epoch when > 1",
    "train.micro_batch": "sizes the packed micro-batch when `max_tokens_per_micro_batch` is 0: room for this many "
                         "sequences (over all data x fsdp devices; verl's `ppo_micro_batch_size_per_gpu` counts per "
                         "GPU) of the longest possible length, so one holds more of shorter responses; each "
                         "micro-batch is one jitted forward/backward call, and their gradients are summed before "
                         "the mini-batch's optimizer step",
    "train.max_tokens_per_micro_batch": "tokens per data x fsdp device of one packed micro-batch (sequences packed "
                                        "back to back, no padding to full width); 0 = the dense micro-batch's share, "
                                        "micro_batch / (data x fsdp) x (max_prompt_length + max_response_length)",
    "train.shared_prefix": "in the update and log-prob passes, responses with the same prompt (a GRPO group) "
                           "share one copy of it in their packed row, attending to it and causally to their own "
                           "tokens, never a sibling's: P + n x R tokens instead of n x (P + R), the same log-probs "
                           "and gradients to float rounding; prompts no other row repeats keep their own copy; "
                           "False = every sequence whole",
    "train.pack_row_lengths": "row lengths the packed passes may use: twice the longest possible sequence (at most "
                              "the micro-batch), then each half the one before; each is one more compiled program "
                              "per pass and row count, all known before the first step",
    "train.pack_fills": "row counts a packed micro-batch may have: the full micro-batch, then half, a quarter, ... "
                        "(the tail of a mini-batch takes the cheapest of them that hold it); programs per "
                        "pass = pack_row_lengths x pack_fills",
    "train.epochs": "passes over the training data (when `max_steps` is -1)",
    "train.max_steps": "RL steps; -1 = epochs x batches per epoch",
    "train.eval_every": "evaluate every this many steps (and at the end)",
    "train.eval_before": "evaluate before the first step",
    "train.eval_n": "sampled responses per test prompt, besides the greedy one",
    "train.eval_ks": "k values of pass@k, maj@k and mean@k, each <= `eval_n` (e.g. `1,4,8`)",
    "train.eval_temperature": "temperature of the sampled evaluation (the reference uses 1.0 with top_p 1)",
    "train.eval_max_prompts": "evaluate at most this many prompts per test file; -1 = all",
    "train.save_generations": "keep every evaluation's responses (row, mode, response, extracted answer, score) as "
                              "`run_dir/generations/<step or eval-time>/<test set>.jsonl`",
    "train.save_every": "asynchronous orbax checkpoint every this many steps (and at the end, and on SIGTERM)",
    "train.save_every_s": "also a checkpoint at the end of the first step when this many seconds have passed "
                          "since the last one (0 = off): steps can be hours apart, a preemption minutes",
    "train.grace_s": "the seconds a stop signal (SIGTERM, SIGINT) leaves before SIGKILL: Spot VMs and SLURM's "
                     "default give 30. The run checkpoints at its next stop point (after the rollout, the update "
                     "or an evaluation), waits for the save, logs its seconds against this (a warning when over) "
                     "and exits with code 75 (stopped, resume me)",
    "train.keep_checkpoints": "checkpoints kept",
    "train.samples_every": "sample completions to the trackers every this many steps",
    "train.loggers": "comma-separated trackers the run's config, scalars, sample completions and end-of-run summary "
                     "go to, from process 0: `tensorboard` (`run_dir/tb`), `wandb` (Weights & Biases: `WANDB_PROJECT`, "
                     "`WANDB_MODE`, ...; extra `[wandb]`), `mlflow` (`MLFLOW_TRACKING_URI`, `MLFLOW_EXPERIMENT_NAME`; "
                     "extra `[mlflow]`); `metrics.jsonl` is always written; a tracker that cannot start stops the run "
                     "at start-up in one line",
    "train.export_at_end": "write the final policy as a Hugging Face folder to `run_dir/export`",
    "train.diagnostics_every": "log the gradient norm per pi_old quartile (`quartile/q{1..4}_grad_norm`) every "
                               "this many steps, and with `isolation_experiment` at the first step the isolation "
                               "experiment (`isolation/{low,high}_q{1..4}`); 0 = off",
    "train.diagnostics_rows": "the rows of the rollout batch those gradient norms are measured on: 0 = the step's "
                              "first mini-batch (`train.mini_batch` rows), -1 = the whole batch (comparable across "
                              "mini-batch sizes: `reproduce --matched` uses it), N = the first N rows",
    "train.isolation_experiment": "with `diagnostics_every`, run the isolation experiment once, before the first "
                                  "update: one optimizer step on the lowest and one on the highest pi_old quartile's "
                                  "tokens from a copy of the policy (two extra steps and three log-prob passes; "
                                  "training does not change). Off by default: that step is a fresh AdamW one, "
                                  "about lr x sign(gradient) for every weight whatever the gradient's size, so it "
                                  "cannot show one quartile's gradient outweighing another's as the paper's "
                                  "Figure 1 does (docs/results/real_model.md, section 4); "
                                  "`analysis/mechanism.py` measures it with an SGD step",
    "reward.fn": "`\"\"` routes by `data_source` (`kk_logic*`, the math sources); or `module:function` with "
                 "verl's signature `(data_source, solution_str, ground_truth, extra_info)`, returning a score or a "
                 "dict with `score`, optionally `acc` (correct or not) and other numbers (logged as "
                 "`reward_info/<key>`, and `eval/<set>/<mode>_info/<key>` in evaluations)",
    "reward.workers": "parallel scoring processes; 0 = the built-in rewards score in the trainer's process (K&K "
                      "scoring is a bounded scan; math-verify runs in its own sandbox process), while a `reward.fn` "
                      "still runs in one worker process, the only place `reward.timeout_s` can stop it",
    "reward.timeout_s": "per-response scoring time limit, seconds: a scoring call that overruns it is stopped and "
                        "the response scores 0, as when scoring raises",
    "reward.correct_at": "what counts as correct in `acc/*`, the evaluation's accuracies, pass@k and maj@k: a score "
                         ">= this; unset: the reward's own `acc` where it returns a verl-style dict, else the task's "
                         "full score (K&K 3, every other source 1); a response whose scoring failed is never correct",
    "env.name": "tool episodes (docs/guides/tools.md): `\"\"` = single-turn responses; a built-in environment "
                "(`calc`: the exact calculator on tasks.calc's problems) or a user's class or factory, "
                "`package.module:Name`; each episode's reward is the sum of its environment's reward parts, and the "
                "loss reads the policy's own tokens alone (the action mask: observations are 0)",
    "env.params": "the environment's parameters as a JSON object, e.g. `{\"call_style\": \"text\", "
                  "\"call_open\": \"<calc>\", \"call_close\": \"</calc>\"}` for a template without tools; "
                  "`\"\"` = its defaults",
    "env.max_turns": "turns per episode: the environment's answer to the last one ends it",
    "env.turn_tokens": "the policy's tokens per turn; a turn also ends at the environment's stop string (a tool "
                       "call's close, matched on device in any tokenization) or an EOS. "
                       "`rollout.max_response_length` caps the episode's tokens after the prompt, observations "
                       "included",
    "env.observation_tokens": "tokens per observation, its frame included; a longer one is cut to fit, ending in "
                              "` [... cut]`",
    "env.observation_format": "`\"\"`: each observation is the chat template's tool message (the template must "
                              "support tools: Qwen2.5, Qwen3); for a template without (SmolLM2) the plain text "
                              "around the tool's output that the warm start teaches, with `{observation}` where it "
                              "goes, e.g. `\\n<output>{observation}</output>\\n`; an empty one with such a "
                              "template stops at start-up",
    "env.template_tools": "True: where the chat template supports tools (Qwen2.5's, Qwen3's), the prompts are "
                          "rendered with its own tools section from the environment's JSON schemas, as "
                          "`apply_chat_template(tools=...)` does (the prompts must then be chat messages, and the "
                          "template must teach the environment's call format: its stop string in that section, "
                          "else start-up stops); False, or a template without tools (SmolLM2's): the prompts as "
                          "the data gives them, whose messages must say how to call the tools",
    "env.step_timeout_s": "seconds the environments' steps (or resets) of one turn's waiting episodes may take in "
                          "all; an episode still running then ends with reward 0 (`episode/env_errors`)",
    "env.workers": "threads that run the environments' resets and steps at once (the tools are subprocesses or "
                   "fast Python)",
    "mesh.data": "data-parallel mesh axis size (-1 = the rest of the devices; of one slice's over several "
                 "TPU slices, see mesh.dcn_data)",
    "mesh.fsdp": "fully sharded data-parallel mesh axis size (-1 = the rest)",
    "mesh.tensor": "tensor-parallel mesh axis size (-1 = the rest)",
    "mesh.dcn_data": "a job over several TPU slices (multislice): mesh.data, fsdp and tensor lay out one slice, and "
                     "the data axis repeats it over this many slices across the data-center network (-1 = every "
                     "slice; it must divide the slice count; the other slices extend fsdp, whose weight gathers "
                     "then cross slices); one slice: 1 or -1",
    "distributed.coordinator": "`host:port` of process 0; `\"\"` = JAX's SLURM detection under `srun` (the step's "
                               "first node, port `JAX_COORDINATOR_PORT` or JAX's), else a single process; `auto` = "
                               "JAX's detection (Cloud TPU)",
    "distributed.num_processes": "process count (0 = JAX's detection: SLURM's or a TPU pod's)",
    "distributed.process_id": "this process's id (-1 = JAX's detection: SLURM's or a TPU pod's)",
    "distributed.heartbeat_timeout_s": "seconds after a process stops sending heartbeats (it died) before the "
                                       "others stop too (JAX's coordination service)",
}
