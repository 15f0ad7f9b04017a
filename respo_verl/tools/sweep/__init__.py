"""The paper's comparison grid as verl runs: expansion, manifest, and launching (``respo-verl sweep``)."""
