"""Non-LLM policies and networks (`/v1/rl/act`, `/v1/predict`): the model format (policy.json +
weights.safetensors), its signature, a registry of building blocks, seeded action distributions,
and the tensors' wire forms. No sockets here: the policy stage drives these."""

from .errors import PolicyLoadError, TensorError
from .policy import ActResult, Policy, save_policy
from .signature import Signature, TensorSpec
from .spec import FORMAT, PolicySpec, parse_spec, read_spec

__all__ = ["ActResult", "FORMAT", "Policy", "PolicyLoadError", "PolicySpec", "Signature", "TensorError",
           "TensorSpec", "parse_spec", "read_spec", "save_policy"]
