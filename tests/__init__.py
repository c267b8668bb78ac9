"""The test suite (a package: a `tests` package that another distribution installs, such as verl's wheel, must not shadow it)."""
