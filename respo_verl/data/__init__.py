"""Training and evaluation data in verl's parquet schema: ``respo-verl prepare-data dapo-math|eval-math``, and the
check of a job's data files before Ray starts (:mod:`.check`)."""
