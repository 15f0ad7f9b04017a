"""Training and evaluation data in verl's parquet schema: ``respo-verl prepare-data dapo-math|eval-math``."""
