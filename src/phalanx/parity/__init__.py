"""`phalanx parity`: run a script on 1 process and on N, and compare how they train."""
