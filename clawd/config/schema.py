"""The whole configuration: one frozen dataclass per section of etc/clawd.toml, in the file's order, and the
checks that read more than one section (docs/ARCHITECTURE.md §9). Each section's own module holds its keys,
their defaults and a line of documentation each; `clawd.config.loading` reads a file into this.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from clawd import devices
from clawd.config.admin import AdminConfig
from clawd.config.auth import AuthConfig
from clawd.config.engine import EngineConfig
from clawd.config.feedback import FeedbackConfig
from clawd.config.gate import GateConfig
from clawd.config.journal import JournalConfig
from clawd.config.judge import JudgeConfig
from clawd.config.learner import LearnerConfig
from clawd.config.logging import LoggingConfig
from clawd.config.model import ModelConfig
from clawd.config.monitors import MonitorsConfig
from clawd.config.privacy import PrivacyConfig
from clawd.config.records import RecordsConfig
from clawd.config.rollouts import RolloutsConfig
from clawd.config.sampling import SamplingConfig
from clawd.config.scoring import ScoringConfig
from clawd.config.server import ServerConfig
from clawd.config.sessions import SessionsConfig
from clawd.config.state import StateConfig
from clawd.config.train import TrainConfig
from clawd.config.versions import VersionsConfig


@dataclass(frozen=True)
class Config:
    # [server]: where clawd listens and the limits of each request
    server: ServerConfig = field(default_factory=ServerConfig)
    # [auth]: API keys, the principals they name and what each may do
    auth: AuthConfig = field(default_factory=AuthConfig)
    # [model]: the Hugging Face directory served and trained
    model: ModelConfig = field(default_factory=ModelConfig)
    # [engine]: the policy and reference engines, their timeouts and weight sync
    engine: EngineConfig = field(default_factory=EngineConfig)
    # [sampling]: the temperatures clawd serves and trains at
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    # [sessions]: how long a conversation lives and how many are held
    sessions: SessionsConfig = field(default_factory=SessionsConfig)
    # [scoring]: how a turn becomes a sample, and how many wait for their judge
    scoring: ScoringConfig = field(default_factory=ScoringConfig)
    # [judge]: the model that scores turns, and the teacher's engine
    judge: JudgeConfig = field(default_factory=JudgeConfig)
    # [feedback]: users' explicit ratings of replies, beside the judge
    feedback: FeedbackConfig = field(default_factory=FeedbackConfig)
    # [journal]: how the sample journal reaches the disk
    journal: JournalConfig = field(default_factory=JournalConfig)
    # [learner]: when a batch goes to the trainer, and the trainer calls' timeouts
    learner: LearnerConfig = field(default_factory=LearnerConfig)
    # [rollouts]: active rollouts beside live chat, from a prompt set and environments
    rollouts: RolloutsConfig = field(default_factory=RolloutsConfig)
    # [train]: the training step, optimizer, loss, trainer world and LoRA
    train: TrainConfig = field(default_factory=TrainConfig)
    # [gate]: the evaluation each new version passes before it serves everyone
    gate: GateConfig = field(default_factory=GateConfig)
    # [monitors]: behaviour monitors per version, and what each drift does
    monitors: MonitorsConfig = field(default_factory=MonitorsConfig)
    # [versions]: the version history and what rollback keeps
    versions: VersionsConfig = field(default_factory=VersionsConfig)
    # [records]: how long turn and judge records are kept
    records: RecordsConfig = field(default_factory=RecordsConfig)
    # [privacy]: PII detection and redaction, retention sweeps
    privacy: PrivacyConfig = field(default_factory=PrivacyConfig)
    # [state]: the state directory and the free space learning keeps on it
    state: StateConfig = field(default_factory=StateConfig)
    # [admin]: the clawctl socket, and whether learning starts paused
    admin: AdminConfig = field(default_factory=AdminConfig)
    # [logging]: the log level
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    # the file this was read from (not a setting)
    source: str = "<defaults>"

    @property
    def state_dir(self) -> Path:
        return Path(self.state.dir)

    @property
    def model_path(self) -> Path:
        return Path(self.model.path)

    @property
    def max_sample_tokens(self) -> int:
        """The longest sample trained: `[learner] max_sample_tokens`, else the trainer's micro-batch budget."""
        return self.learner.max_sample_tokens or self.train.micro_batch_tokens

    @property
    def priority_scheduling(self) -> bool:
        """Whether the policy engines schedule by priority: `[engine] priority_scheduling`, auto = while rollouts
        run (with none, every call would carry the same priority)."""
        setting = self.engine.priority_scheduling
        return setting == "on" or (setting == "auto" and self.rollouts.enabled)

    @property
    def reference_engine_needed(self) -> bool:
        """The frozen reference engine serves the judge and the teacher when they are set to it. Not in LoRA
        mode: there the reference is the policy engine's base model, asked without an adapter."""
        judge = self.judge.backend == "sglang" and self.judge.engine == "reference"
        teacher = self.scoring.mode != "rl" and self.judge.teacher_engine == "reference"
        kl = self.train.loss.kl_coef > 0  # the KL term's log-probs are scored there, not in the trainer
        return (judge or teacher or kl) and not self.train.lora.enabled


    def problems(self) -> dict[str, str]:
        """What no one section can see: {dotted key: problem}."""
        if problem := devices.placement_problem(self):  # which role runs on which GPU
            key, text = problem
            return {key: text}
        dp = devices.flag_value(self.engine.sglang_args, "--dp-size", "--data-parallel-size", "--dp") or "1"
        if self.train.lora.enabled and dp.isdigit() and int(dp) > 1:
            return {"engine.sglang_args": "--dp-size above 1 with train.lora.rank > 0: SGLang loads no adapter on "
                                          "data-parallel replicas; use [engine] replicas = N instead"}
        if self.reference_engine_needed and self.engine.reference_url in self.engine.policy_urls:
            return {"engine.reference_url": f"{self.engine.reference_url} is a policy replica's URL (replicas take "
                                            f"url's port and the next ones)"}
        if self.rollouts.enabled and self.scoring.mode == "opd":
            return {"rollouts.enabled": "rollouts train the RL term (their group advantages): scoring.mode must be "
                                        "\"rl\" or \"combine\", not \"opd\""}
        if self.rollouts.enabled and not self.learner.enabled:
            return {"rollouts.enabled": "rollouts only feed the learner: learner.enabled is false"}
        if not self.auth.keys and not self.server.loopback and not self.auth.allow_open:
            return {"auth.keys": f"none, and server.host {self.server.host} is not loopback: anyone who reaches it "
                                 "could chat and train the model (set auth.allow_open = true to mean it)"}
        return {}
