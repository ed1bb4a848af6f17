"""A NeMo Gym resources server (a stand-in `add` tool task written with nemo-gym's API) and its agent fn."""
