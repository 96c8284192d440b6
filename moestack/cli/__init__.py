"""The `moestack` command line (the top layer). app.py: the typer app, `train`, one-line errors and main();
profile.py / plan.py / adapt.py: the `profile`, `plan` + `tune` + `tune-comm`, `adapt` + `convert` commands."""
