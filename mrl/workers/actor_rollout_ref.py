"""`ActorRolloutRefWorker`: the actor (trained), the reference policy, a distillation teacher and colocated reward
models (frozen) and the handle of the rollout replicas, in one process per device slot.

Group methods are dispatched by the actor engine's mesh (`nd_compute("actor")`): TP/PP ranks of one DP group get
the same chunk, results come back from TP 0 of the last stage. Read-only calls (`compute_log_prob`,
`compute_ref_log_prob`, `compute_teacher_log_prob`, `compute_reward_scores`) accept dispatch padding;
`update_actor` never does: the trainer sends counts that divide the DP size and the number of updates (no-op
samples with an all-zero response mask).

Group methods receive the step's light batch (store keys and scalar columns, mrl/data/samples.py), fetch the
per-token fields of their rows from the sample store by key, and write their per-token outputs (`old_log_probs`,
`ref_log_prob`, `teacher_log_prob`, token-level `advantages`/`returns`; per sample, a colocated reward model's
score) back under the same keys; only scalars return to the driver. Token fields are jagged and aligned with
`input_ids` (prompt + response): `response_mask` (1 on model tokens), `rollout_log_probs`, …; log-prob t scores
token t (DESIGN.md).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import torch

from mrl.algo.actor_loss import ActorLossConfig, actor_loss
from mrl.algo.advantages import AdvantageConfig
from mrl.algo.kl import KLController
from mrl.algo.policy_loss import PolicyLossConfig
from mrl.algo.rollout_correction import apply_rollout_correction, correction_config, correction_stats
from mrl.config.schema import MrlConfig
from mrl.controller import Dispatch, Execute, Worker, nd_compute, register
from mrl.data.batch import Batch
from mrl.data.jagged import JaggedTensor
from mrl.data.samples import write_back
from mrl.engine.megatron.routing import routing_metrics
from mrl.reward.models import reward_score_field
from mrl.utils.phase_memory import phase_memory, tracks_memory
from mrl.workers.cpu_threads import worker_threads
from mrl.workers.token_level import (
    distill_token_advantages,
    rank_mismatch,
    token_advantages,
    token_level_advantages,
)
from mrl.workers.training_worker import (
    DeviceHandover,
    StoreClient,
    TrainingWorker,
    jagged_from_flat,
    loss_scale_factor,
    scheduled_updates,
    to_engine_batch,
)

ACTOR_MESH = "actor"
POLICY_LOSS_NAMES = {"ppo_clip": "vanilla"}  # config name → algorithm library name (others pass through)


def colocated_reward_models(config: MrlConfig) -> list[Any]:
    """Discriminative reward.models placed `colocated`: frozen engines in these workers (a colocated judge has
    replicas on the trainer's devices instead)."""
    return [m for m in config.reward.models if m.placement == "colocated" and m.kind == "discriminative"]


def actor_loss_config(config: MrlConfig) -> ActorLossConfig:
    """The actor's loss settings from a run's config (`actor.*`, `algorithm.rollout_correction`)."""
    actor, algorithm = config.actor, config.algorithm
    correction = correction_config(algorithm.rollout_correction)
    return ActorLossConfig(
        policy_loss=PolicyLossConfig(
            loss_mode=POLICY_LOSS_NAMES.get(actor.policy_loss, actor.policy_loss),
            clip_ratio_low=actor.clip_ratio_low,
            clip_ratio_high=actor.clip_ratio_high,
            clip_ratio_c=actor.clip_ratio_c,
        ),
        loss_agg_mode=actor.loss_agg_mode,
        loss_scale_factor=loss_scale_factor(config),
        entropy_coeff=actor.entropy_coeff,
        use_kl_loss=actor.use_kl_loss,
        kl_loss_coef=actor.kl_loss_coef,
        kl_loss_type=actor.kl_loss_type,
        rollout_correction=correction,
    )


def make_actor_loss_fn(config: ActorLossConfig, on_policy: bool = False) -> Any:
    """The actor's loss; `on_policy`: π_old is the forward's own log-probs (the weights it runs on are π_old's),
    and a rollout correction weighs those against the rollout's log-probs as it does stored ones."""

    def loss_fn(outputs: Any, mb: Any, normalizer: Any) -> Any:
        return actor_loss(
            outputs["log_probs"],
            outputs["log_probs"].detach() if on_policy else mb["old_log_probs"],
            mb["advantages"],
            mb["response_mask"],
            normalizer,
            config,
            entropy=outputs.get("entropy"),
            ref_log_prob=mb.get("ref_log_prob"),
            rollout_log_prob=mb.get("rollout_log_probs"),
        )

    return loss_fn


class ActorRolloutRefWorker(StoreClient, DeviceHandover, Worker):
    def __init__(self, config: MrlConfig, with_ref: bool = False) -> None:
        super().__init__()
        torch.set_num_threads(worker_threads(config, torch.cuda.is_available()))  # mrl/workers/cpu_threads.py
        self.config = config
        self.with_ref = with_ref
        self.actor: TrainingWorker | None = None
        self.ref: TrainingWorker | None = None
        self.teacher: TrainingWorker | None = None  # algorithm.distill: frozen, like the reference
        self.reward_models: dict[str, TrainingWorker] = {}  # reward.models placed colocated: frozen too, by name
        self.rollout: Any = None
        self._adapter_folders: Any = None  # actor.lora.sync=adapter: the PEFT folders per version (rank 0)
        loss_config = actor_loss_config(config)
        self.correction = loss_config.rollout_correction
        self.loss_fn = make_actor_loss_fn(loss_config)
        self.on_policy_loss_fn = make_actor_loss_fn(loss_config, on_policy=True)

    def _engine(self, role: str, path: str | None = None, engine_class: type | None = None) -> Any:
        """The engine of `role`: the actor (trained), or a frozen, forward-only one on ref.megatron's layout: the
        reference (model.path), the distillation teacher (algorithm.distill.teacher_path) or a colocated reward
        model (`path`, a `MegatronRewardModel`)."""
        from mrl.engine.megatron.engine import MegatronEngine

        c = self.config
        trainable = role == "actor"
        micro = c.actor.ppo_micro_batch_size_per_gpu if trainable else c.ref.log_prob_micro_batch_size_per_gpu
        dynamic = c.actor.use_dynamic_bsz
        # The reference replays the rollout's routing under R3 too: it takes the actor's router_replay. A teacher's
        # or reward model's experts are not the student's: it routes by itself.
        replay = c.actor.megatron.router_replay if role == "ref" else "none"
        megatron = c.actor.megatron if trainable else dataclasses.replace(c.ref.megatron, router_replay=replay)
        engine = (engine_class or MegatronEngine)(
            path or (c.algorithm.distill.teacher_path if role == "teacher" else c.model.path),
            megatron,
            c.actor.optim if trainable else None,
            micro_batch_size=None if dynamic else micro,
            max_tokens_per_micro_batch=c.actor.ppo_max_token_len_per_gpu if dynamic else None,
            total_steps=scheduled_updates(c, c.actor.ppo_mini_batch_size, c.actor.ppo_epochs),
            seed=c.trainer.seed,
            bridge_backend=c.model.bridge_backend,
            lora=c.actor.lora if trainable else None,
            temperature=c.rollout.temperature,  # old, new, reference and teacher log-probs: the sampled distribution's
        )
        engine.initialize()
        return engine

    @register(Dispatch.ONE_TO_ALL, blocking=False)
    def init_model(self) -> None:
        """Build the engines (the reference shares the actor's layout). Non-blocking, so the driver can start the
        rollout replicas meanwhile."""
        self.actor = TrainingWorker(self._engine("actor"))
        if self.with_ref and not self.config.actor.lora.enable:  # LoRA: the reference is the actor, adapters off
            self.ref = TrainingWorker(self._engine("ref"))
        distill = self.config.algorithm.distill
        if distill.enable and distill.placement == "colocated":  # a pool's teacher has replicas of its own
            self.teacher = TrainingWorker(self._engine("teacher"))
        from mrl.engine.megatron.critic import MegatronRewardModel

        self.reward_models = {m.name: TrainingWorker(self._engine("reward", m.path, MegatronRewardModel))
                              for m in colocated_reward_models(self.config)}
        self.register_mesh(ACTOR_MESH, self.actor.engine.mesh())

    @property
    def old_log_prob_field(self) -> str:
        # Bypass (rollout.recompute_old_log_prob=false): the rollout's log-probs are π_old.
        return "old_log_probs" if self.config.rollout.recompute_old_log_prob else "rollout_log_probs"

    @register(Dispatch.ONE_TO_ALL)
    def set_rollout(self, rollout: Any) -> None:
        """The rollout manager (LLMServerManager) that `update_weights` pushes to."""
        self.rollout = rollout

    def on_policy_rows(self, rows: int, num_updates: int) -> int:
        """How many leading rows of this rank's share train on-policy in `update_actor`: the first mini-batch's
        update runs on the weights π_old is computed with, so its forward's log-probs are π_old and the old
        log-prob pass skips those rows (1/num_updates of it). Only with one pass over the data (ppo_epochs 1), when
        nothing reads π_old before the update (KL in reward and distillation do) and with more than one update, so
        the mismatch metrics keep rows to measure. Not under rollout-correction rejection either: it edits the
        response mask from π_old, and the engine counts the loss denominators from that mask before the update's
        forward."""
        c = self.config
        reads_old = c.algorithm.use_kl_in_reward or c.algorithm.distill.enable
        if (not c.actor.on_policy_first_update or not c.rollout.recompute_old_log_prob or c.actor.ppo_epochs != 1
                or num_updates < 2 or reads_old or self.correction.rejects):
            return 0
        return rows // num_updates

    @register(nd_compute(ACTOR_MESH), pad=True)
    @tracks_memory("old_log_prob")
    def compute_log_prob(self, batch: Batch, num_updates: int = 1) -> dict[str, float]:
        """`old_log_probs` of every token under the current actor, into the store; returns this rank's
        rollout-vs-trainer mismatch (`rank_mismatch`) and, under "correction", the sums behind the rollout
        correction's metrics per weight version (`correction_stats`). Under rejection (`rollout_rs`, the veto) the
        stored `response_mask` loses the rejected tokens. Given the step's `num_updates`, rows that `update_actor`
        trains on-policy are skipped (`on_policy_rows`)."""
        batch = batch[self.on_policy_rows(len(batch), num_updates):]
        replay = self.config.actor.megatron.router_replay
        fetched = self.fetch(batch, ["input_ids", "response_mask", "rollout_log_probs", *self.replayed_fields("old")])
        outputs = self._infer(self.actor, fetched, routing=replay != "none")
        fetched["old_log_probs"] = outputs["log_probs"]
        written = {"old_log_probs": fetched.jagged_field("old_log_probs")}
        if replay == "old_log_prob":  # R2: the update replays what this pass routed by
            written["routed_experts"] = outputs["routed_experts"]
        padded = {k: fetched.as_padded(k)[0] for k in ("old_log_probs", "rollout_log_probs", "response_mask")}
        if self.correction.rejects:
            # As verl: rejected tokens leave the response mask itself, so every term of the update (and the critic's)
            # and the step-global denominators, counted from the stored mask before any forward, leave them out.
            _, kept = apply_rollout_correction(padded["old_log_probs"], padded["rollout_log_probs"],
                                               padded["response_mask"], self.correction)
            mask = fetched.jagged_field("response_mask")
            written["response_mask"] = JaggedTensor.from_padded(kept.to(mask.values.dtype), mask.lengths())
        self.write(ACTOR_MESH, batch, written)
        routing = {}
        if replay == "rollout":
            num_experts = self.actor.engine.tf_config.num_moe_experts  # type: ignore[union-attr]
            routing = routing_metrics(outputs["own_experts"].values, fetched.jagged_field("routed_experts").values,
                                      num_experts, used=outputs["routed_experts"].values)
        versions = batch["min_version"] if "min_version" in batch else torch.full((len(batch),), -1)
        stats = correction_stats(padded["old_log_probs"], padded["rollout_log_probs"], padded["response_mask"],
                                 self.correction, versions)
        return {**rank_mismatch(fetched), "correction": stats, "routing": routing}

    @register(nd_compute(ACTOR_MESH), pad=True)
    @tracks_memory("ref")
    def compute_ref_log_prob(self, batch: Batch) -> None:
        """`ref_log_prob` of every token under the reference policy, into the store."""
        lora = self.actor is not None and bool(self.actor.engine.adapters)
        if self.ref is None and not (self.with_ref and lora):
            raise RuntimeError("compute_ref_log_prob: this worker was built without a reference policy")
        fetched = self.fetch(batch, ["input_ids", *self.replayed_fields("ref")])
        if lora:
            with self.actor.engine.adapters_disabled():  # type: ignore[union-attr]
                fetched["ref_log_prob"] = self._infer(self.actor, fetched)["log_probs"]
        else:
            fetched["ref_log_prob"] = self._infer(self.ref, fetched)["log_probs"]
        self.write(ACTOR_MESH, batch, {"ref_log_prob": fetched.jagged_field("ref_log_prob")})

    @register(nd_compute(ACTOR_MESH), pad=True)
    @tracks_memory("teacher")
    def compute_teacher_log_prob(self, batch: Batch) -> None:
        """`teacher_log_prob` of every token under the distillation teacher, into the store."""
        if self.teacher is None:
            raise RuntimeError("compute_teacher_log_prob: this worker was built without algorithm.distill")
        fetched = self.fetch(batch, ["input_ids"])
        fetched["teacher_log_prob"] = self._infer(self.teacher, fetched)["log_probs"]
        self.write(ACTOR_MESH, batch, {"teacher_log_prob": fetched.jagged_field("teacher_log_prob")})

    @register(nd_compute(ACTOR_MESH), pad=True)
    @tracks_memory("reward_models")
    def compute_reward_scores(self, batch: Batch) -> None:
        """Each colocated reward model's score of every sample (its output at the sample's last token, as the pool's
        HF forward reads it) into the store as `reward_score_field(name)`: one value per sample."""
        fetched = self.fetch(batch, ["input_ids"])
        ids = fetched.jagged_field("input_ids")
        last = ids.offsets[1:] - 1
        engine_batch = to_engine_batch(fetched, ["input_ids"])
        written = {}
        for name, model in self.reward_models.items():
            scores = model.infer_batch(engine_batch)["scores"][last]
            written[reward_score_field(name)] = JaggedTensor(scores, torch.arange(len(last) + 1))
        self.write(ACTOR_MESH, batch, written)

    @register(nd_compute(ACTOR_MESH))
    def compute_distill_advantages(self, batch: Batch) -> dict[str, float]:
        """Per-token `advantages` of distillation (mrl/workers/token_level.py `distill_token_advantages`), into the
        store; with mode `add` on top of the task's: the per-sample `advantage` column or the token-level ones the
        store holds. Rows are independent, so each DP rank does its own. Returns this rank's `distill/kl` and its
        model-token count."""
        d = self.config.algorithm.distill
        fields = ["response_mask", "old_log_probs", "teacher_log_prob"]
        fields += ["advantages"] if d.mode == "add" and "advantage" not in batch else []
        fetched = self.fetch(batch, fields)
        advantages, metrics = distill_token_advantages(fetched, d.coef, add=d.mode == "add")
        self.write(ACTOR_MESH, batch, {"advantages": advantages})
        return metrics

    def replayed_fields(self, phase: str) -> list[str]:
        """The routing a pass replays (actor.megatron.router_replay): R3 the rollout's in every pass, R2 the
        old-log-prob pass's in the update. Rows the first update trains on-policy had no old-log-prob pass: under
        R2 their update routes by itself, which is what the old-log-prob pass would have recorded."""
        replay = self.config.actor.megatron.router_replay
        return ["routed_experts"] if replay == "rollout" or (replay == "old_log_prob" and phase == "update") else []

    def _infer(self, role: TrainingWorker | None, batch: Batch, routing: bool = False) -> dict[str, JaggedTensor]:
        """The engine's per-token outputs as jagged fields aligned with `batch` (log_probs; routing with it)."""
        assert role is not None, "init_model first"
        keys = ["input_ids", *(["routed_experts"] if "routed_experts" in batch else [])]
        outputs = role.infer_batch(to_engine_batch(batch, keys), routing=routing)
        ids = batch.jagged_field("input_ids")
        return {k: jagged_from_flat(v, ids) for k, v in outputs.items()}

    @register(Dispatch.ONE_TO_ALL, execute_mode=Execute.RANK_ZERO)
    def compute_token_advantages(self, batch: Batch, estimator: str, config: AdvantageConfig,
                                 kl_ctrl: KLController | None, kl_type: str
                                 ) -> tuple[dict[str, float], KLController | None]:
        """Token-level `advantages` and `returns` (GAE; any estimator with KL-in-reward) of the whole step's
        batch, into the store, on one rank (group estimators need whole groups; the KL coefficient needs the
        batch's KL). Returns the KL metrics and the controller after its update."""
        fields = ["response_mask"] + (["values"] if self.config.critic.enable else [])
        fields += ["old_log_probs", "ref_log_prob"] if kl_ctrl is not None else []
        fetched = self.fetch(batch, fields)
        outputs, metrics = token_level_advantages(fetched, estimator, config, kl_ctrl, kl_type)
        write_back(self.store, batch, outputs)
        return metrics, kl_ctrl

    @register(nd_compute(ACTOR_MESH))
    @tracks_memory("update_actor")
    def update_actor(self, batch: Batch, num_updates: int) -> dict[str, Any]:
        """`num_updates` optimizer updates over this DP rank's share (× ppo_epochs); their metrics and count. The
        first mini-batch may train on-policy (`on_policy_rows`): π_old from its own forward."""
        assert self.actor is not None, "init_model first"
        before = self.actor.updates
        on_policy = self.on_policy_rows(len(batch), num_updates)
        steps = []
        if on_policy:
            first = self._update_inputs(batch[:on_policy], with_old=False)
            steps += self.actor.train_batch(first, self.on_policy_loss_fn, 1)
            batch, num_updates = batch[on_policy:], num_updates - 1
        steps += self.actor.train_batch(self._update_inputs(batch, with_old=True), self.loss_fn, num_updates,
                                        epochs=self.config.actor.ppo_epochs)
        return {"updates": self.actor.updates - before, "steps": steps}

    def _update_inputs(self, batch: Batch, with_old: bool) -> Any:
        """The engine batch of an update, fetched by key. Outcome estimators send one `advantage` per sample,
        spread here over model tokens; token-level ones left `advantages` in the store. A rollout correction also
        needs the rollout's log-probs (a field apart from π_old and π_ref)."""
        keys = ["input_ids", "response_mask"] + (["old_log_probs"] if with_old else [])
        keys += self.replayed_fields("update" if with_old else "on_policy")
        keys += ["rollout_log_probs"] if self.correction.enabled else []
        keys += ["ref_log_prob"] if self.config.actor.use_kl_loss else []
        batch = self.fetch(batch, keys + ([] if "advantage" in batch else ["advantages"]))
        if "advantage" in batch:
            batch["advantages"] = token_advantages(batch)
        return to_engine_batch(batch, [*keys, "advantages"])

    @register(Dispatch.ONE_TO_ALL)
    def export_to_host(self) -> dict[str, torch.Tensor]:
        """The actor's HF-named export as host tensors on rank 0 ({} elsewhere; every rank joins the gathers): what
        a weight sync sends, for checks against the engine's read-back. Needs the parameters on the device."""
        exported = {name: t.to("cpu", copy=True) for name, t in self.actor.engine.export_weights()}  # type: ignore[union-attr]
        return exported if self.rank == 0 else {}

    @register(Dispatch.ONE_TO_ALL)
    @tracks_memory("update_weights")
    def update_weights(self, global_steps: int) -> dict[str, Any]:
        """Stream the actor's HF-named weights to every rollout replica, stamped with `global_steps`, through the
        transport `weight_sync.transport` (mrl/weight_sync).

        Every rank iterates the export (it gathers over TP and broadcasts from the owning PP stage). With `ipc`
        every rank ships it to the engine workers on its own device, as TP slices where the layouts pair
        (mrl/rollout/device_sync.py); otherwise rank 0 ships it to all. Returns what this rank sent (tensors,
        bytes as slices and whole; rank 0: tensors loaded per replica).
        """
        assert self.actor is not None, "init_model first"
        ws, lora = self.config.weight_sync, self.config.actor.lora
        if lora.enable and lora.sync == "adapter":
            return self._sync_adapter(global_steps)
        if ws.transport == "ipc" and self.rollout is not None:
            from mrl.rollout.device_sync import sync_per_device, tp_slices_pair

            trainer_tp = self.config.actor.megatron.tensor_model_parallel_size
            slices = ws.tp_slices and self.rollout.pd is None and tp_slices_pair(self.rollout.spec.footprint,
                                                                                 trainer_tp)
            # one copy: the sender shares fused QKV's q/k/v as row blocks of the trainer's memory (no export copy)
            blocks = ws.one_copy and torch.cuda.is_available()
            spent: dict[str, float] = {}
            stream = self._quantized(self.actor.engine.export_weights(tp_slices=slices, row_blocks=blocks), spent)
            return {**sync_per_device(self.rollout, stream, global_steps, ws.bucket_size_mb << 20, ws.timeout_s,
                                      **ws.sender_kwargs()), **spent}
        stream = self.actor.engine.export_weights()
        if self.rank == 0 and self.rollout is not None:
            from mrl.rollout.device_sync import SentBytes

            sent, spent = SentBytes(receivers=["rollout"]), {}
            stream = sent.count(self._quantized(stream, spent))  # bytes as sent: FP8 ones with quantization=fp8
            counts = self.rollout.update_weights(stream, global_steps, ws.bucket_size_mb << 20,
                                                 transport=ws.transport, timeout_s=ws.timeout_s, **ws.sender_kwargs())
            return {**sent.metrics(), **spent, "replica_tensors": counts}
        for _ in stream:
            pass
        return {}

    def _quantized(self, stream: Iterator[tuple], spent: dict[str, float]) -> Iterator[tuple]:
        """The export as the engine loads it: with rollout.quantization=fp8 each linear weight becomes block-FP8
        bytes and scales, quantised here on the trainer's device tensor by tensor (mrl/weight_sync/fp8.py), the host
        seconds it takes gathered in `spent["quantize_s"]`."""
        if self.config.rollout.quantization != "fp8":
            return stream
        from mrl.weight_sync.fp8 import quantized_stream

        return quantized_stream(stream, self.config.rollout.fp8_scale_format == "ue8m0", spent)

    def _sync_adapter(self, version: int) -> dict[str, Any]:
        """actor.lora.sync=adapter: every rank joins the adapters' gather; rank 0 writes them as a PEFT folder
        (version-stamped, on tmpfs) and has every replica load it, then deletes the previous version's folder."""
        from mrl.engine.megatron import lora_peft
        from mrl.rollout.device_sync import SentBytes

        engine = self.actor.engine  # type: ignore[union-attr]
        tensors = lora_peft.gather_tensors(engine.bridge, engine.unwrapped())
        if self.rank != 0 or self.rollout is None:
            return {}
        if self._adapter_folders is None:
            self._adapter_folders = lora_peft.AdapterFolders(self.config.actor.lora.adapter_dir)
        path = self._adapter_folders.path(version)
        nbytes = lora_peft.write_folder(path, tensors, self.config.actor.lora, self.config.model.path)
        counts = self.rollout.load_lora_adapter(path, version)
        self._adapter_folders.replace(path)
        return {**SentBytes(len(tensors), 0, nbytes, ["rollout"]).metrics(), "replica_tensors": counts}

    @register(Dispatch.ONE_TO_ALL)
    def memory_stats(self) -> dict[str, Any]:
        """Peak memory of each tracked phase since the last call (mrl/utils/phase_memory.py), and the actor's
        optimizer-state bytes and trainable parameters on this rank."""
        sizes = self.actor.engine.state_sizes() if self.actor is not None else {}  # type: ignore[union-attr]
        return {**phase_memory(self).take(), **sizes}

    def training_roles(self) -> list[tuple[TrainingWorker, Any]]:
        roles = [(self.actor, self.config.actor.megatron), (self.ref, self.config.ref.megatron),
                 (self.teacher, self.config.ref.megatron),
                 *((rm, self.config.ref.megatron) for rm in self.reward_models.values())]
        return [(role, m) for role, m in roles if role is not None]

    @register(Dispatch.ONE_TO_ALL)
    def save_checkpoint(self, path: str) -> None:
        assert self.actor is not None
        self.actor.save_checkpoint(path)

    @register(Dispatch.ONE_TO_ALL)
    def load_checkpoint(self, path: str) -> None:
        assert self.actor is not None
        self.actor.load_checkpoint(path)

    @register(Dispatch.ONE_TO_ALL)
    def optimizer_updates(self) -> int:
        assert self.actor is not None
        return self.actor.updates
