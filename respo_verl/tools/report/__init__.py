"""Reading verl file-logger logs and reporting a comparison in the paper's layout (``respo-verl report``)."""
