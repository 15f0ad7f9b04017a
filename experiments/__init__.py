"""Research code built on respo_verl: depends on the package, never the reverse, and can be deleted whole."""
