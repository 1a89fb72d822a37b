"""Declared, restricted-type state of the chain's stages, the resume fingerprint and elastic resize.

* ``savable``: ``Savable`` (state = the declared ``_savable_fields``) and ``Stage`` (owns ``self.source``, inherits
  delegation); ``walk`` the nested stateful objects of a chain;
* ``protocol``: the two save/restore protocols (ours/torch's and Energon's per-rank one) and the tagged nested form;
* ``restricted``: what Megatron-Bridge's restricted unpickler accepts (``check_restricted``);
* ``fingerprint``: what must match for a state to apply, built in one place (``fingerprint_of``), and its diff;
* ``resize``: ``ResizeContext``, a resize dispatched through the live chain's ``resize_state`` methods.
"""

from .fingerprint import (ABSENT, BUDGET_CHANGE_KEY, ELASTIC_TOPOLOGY_KEYS, FRESH_STREAM_KEY, ResumeMismatchError,
                          fingerprint_changes, fingerprint_diff, fingerprint_of, mismatch_message)
from .protocol import (STATE_PROTOCOLS, StateError, energon_rank_state, is_stateful, is_stateful_list, load_nested,
                       load_value, restore_of, save_nested, save_of, save_value, state_protocol, tag_of)
from .resize import ResizeContext
from .restricted import check_restricted, energon_state_classes
from .savable import Savable, Stage, check_fields, unsavable_fields, walk

__all__ = ["ABSENT", "BUDGET_CHANGE_KEY", "ELASTIC_TOPOLOGY_KEYS", "FRESH_STREAM_KEY", "STATE_PROTOCOLS",
           "ResizeContext", "ResumeMismatchError", "Savable", "Stage", "StateError", "check_fields", "check_restricted",
           "energon_rank_state", "energon_state_classes", "fingerprint_changes", "fingerprint_diff", "fingerprint_of",
           "is_stateful", "is_stateful_list", "load_nested", "load_value", "mismatch_message", "restore_of",
           "save_nested", "save_of", "save_value", "state_protocol", "tag_of", "unsavable_fields", "walk"]
