/* A fixture for the layers.detects_file_circle test, not library code:
 * circle_a.c -> circle_b.c -> circle_c.c -> circle_a.c, each calling the
 * next, a circle of three files that no two of them make alone. Built as
 * objects only (tests/CMakeLists.txt: dmem_layers_circle), never linked. */
int dmem_circle_b_step(int depth);

int dmem_circle_a_step(int depth) { return depth > 0 ? dmem_circle_b_step(depth - 1) : 0; }
