"""The run manifest now lives in :mod:`respo_verl.runs.manifest`; these names are re-exported from there."""

from respo_verl.runs.manifest import LOG_STEPS, MANIFEST_NAME, RunRecord, read_manifest, write_manifest

__all__ = ["LOG_STEPS", "MANIFEST_NAME", "RunRecord", "read_manifest", "write_manifest"]
