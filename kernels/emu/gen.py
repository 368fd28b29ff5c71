"""Makes the emulation's kernel file: common.cuh, then a kernel source with its inline-PTX
helpers (smem_u32 .. mma16, replaced by emu.h) cut out and `extern __shared__` arrays pointed
at the emulated block's shared memory. Usage: gen.py SOURCE.cu COMMON.cuh OUT.cu"""
import sys

src_path, common_path, out_path = sys.argv[1:4]
src = open(src_path).read()
a = src.index("__device__ __forceinline__ u32 smem_u32(const void* p) {")
b = src.index("// The descriptor fits the buffers")
src = src[:a] + "// (inline-PTX helpers: emu.h)\n" + src[b:]
decl = "extern __shared__ __align__(16) unsigned char dsmem[];"
n = src.count(decl)
src = src.replace(decl, "unsigned char* dsmem = g_smem;")
if "asm" in src.replace("// (inline-PTX helpers: emu.h)", ""):
    sys.exit("gen.py: inline PTX left outside the cut helpers; emu.h cannot run it")
open(out_path, "w").write(open(common_path).read() + "\n" + src)
print(f"gen.py: {n} kernels with dynamic shared memory")
