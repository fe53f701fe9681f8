"""PyTorch interop: drafts to and from the original EAGLE-2 / Jakiro / Gumiho layouts."""

from jakiro_jax.export.reference_dir import (read_reference_dir, read_state_dict,
                                             reference_config, write_reference_dir,
                                             write_target_hf_dir)
from jakiro_jax.drafts.torch_layout import (check_state_dict, from_reference_state_dict,
                                            reference_shapes, to_reference_state_dict)

__all__ = ["read_reference_dir", "read_state_dict", "reference_config", "write_reference_dir",
           "write_target_hf_dir", "check_state_dict", "from_reference_state_dict",
           "reference_shapes", "to_reference_state_dict"]
