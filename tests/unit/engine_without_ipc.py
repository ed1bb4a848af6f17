"""A `plugins` module for the config rules' test: an engine kind that takes the tensor transport but not as
CUDA-IPC handles, the only way to break `cuda_ipc_needs_an_engine_that_takes_it` (every built-in engine kind
that takes the transport satisfies it)."""

from verst.config.registries import ENGINE_KINDS

ENGINE_KINDS.register("no_ipc", doc="takes the tensor transport as shared memory only", transports=("tensor",))(object())
