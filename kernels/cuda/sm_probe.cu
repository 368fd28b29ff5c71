// Test probe: each block records the SM it ran on and its start and end times (globaltimer,
// ns) around a spin of `spin` clocks; launched on two SM partitions at once, it shows where each
// partition's blocks land and that the two ran concurrently.
extern "C" __global__ void sm_probe(unsigned* smid, unsigned long long* t, long long spin) {
  if (threadIdx.x != 0) return;
  unsigned s; asm volatile("mov.u32 %0, %%smid;" : "=r"(s));
  unsigned long long t0, t1;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
  long long c0 = clock64();
  while (clock64() - c0 < spin) {}
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t1));
  smid[blockIdx.x] = s;
  t[2 * blockIdx.x] = t0;
  t[2 * blockIdx.x + 1] = t1;
}
