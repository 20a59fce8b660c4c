"""The simulated kernel and fake hosts: what tests, the demo and snapshot replay run on."""
