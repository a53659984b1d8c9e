"""Hosts of the one reload inside an inference engine: the vLLM / vllm-ascend worker extension
and the weight-transfer backend. They sit above the runtime and import it; nothing on a rank
imports them."""
