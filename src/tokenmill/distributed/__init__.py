"""Parallel execution state and collectives. parallel_state.py knows this process's tensor-parallel rank;
communication.py is the only module that calls torch.distributed collectives."""
