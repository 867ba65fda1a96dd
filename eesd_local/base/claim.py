"""What eesd-local promises about its output, in the words every place that says it uses
(README, ``eesd --help``, ``eesd-chat --help``, the API docstring); :mod:`eesd_local.speculative.lossless`
holds the check of a run against plain decoding. A module of its own so that the command-line
entry points can say it before they import llama.cpp."""

from __future__ import annotations

# what eesd-local promises, in these words wherever it is said (README, --help, the API docstring)
CLAIM = ("On the CPU, greedy output is byte-identical to plain decoding, whatever the drafter, the controller and "
         "the timing (elsewhere, such as on a GPU, it can leave plain decoding's at a near tie, and `eesd generate -v` "
         'says so); sampling keeps the target\'s exact distribution (real speculative sampling, not "sample and match").')
