"""Pure-Python decisions shared by the simulator and the executor: no simpy, no torch."""
