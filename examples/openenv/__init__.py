"""An OpenEnv environment (a stand-in arithmetic env written with openenv-core's API) played by an agent fn."""
