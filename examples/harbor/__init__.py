"""A Harbor task run by verst's Harbor connector, with a stand-in host environment and agent written with
harbor's API (for machines without a container runtime)."""
