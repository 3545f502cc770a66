"""Each lab's check, in a module of its own: labs/NN_*.py ends by handing its functions to checks/labNN.py."""
