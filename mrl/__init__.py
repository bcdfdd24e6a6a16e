"""mrl: Megatron-native RL post-training for LLMs, dense and MoE."""

from mrl._compat import check_megatron_core

check_megatron_core()

__version__ = "0.1.0"
