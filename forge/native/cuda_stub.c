/* A stand-in for the NVIDIA driver library (libcuda.so.1) on hosts without a GPU.
 *
 * Monarch 0.1.2's native module links against libcuda.so.1 even when no GPU is used. On a CPU-only
 * host forge builds this file into .native/lib/libcuda.so.1 so the import succeeds; every entry point
 * reports CUDA_ERROR_NO_DEVICE, so nothing can mistake it for a GPU. It is only ever put on the
 * library path when no real driver can be loaded (see forge/native/__init__.py).
 */
typedef int CUresult;
#define CUDA_ERROR_NO_DEVICE 100

static const char *kMessage = "no CUDA device (forge CPU stub of libcuda.so.1)";

CUresult cuInit(unsigned int flags) { (void)flags; return CUDA_ERROR_NO_DEVICE; }
CUresult cuDriverGetVersion(int *version) { if (version) *version = 0; return CUDA_ERROR_NO_DEVICE; }
CUresult cuDeviceGetCount(int *count) { if (count) *count = 0; return CUDA_ERROR_NO_DEVICE; }
CUresult cuDeviceGet(int *device, int ordinal) { (void)device; (void)ordinal; return CUDA_ERROR_NO_DEVICE; }
CUresult cuDeviceGetAttribute(int *value, int attribute, int device) {
  (void)value; (void)attribute; (void)device; return CUDA_ERROR_NO_DEVICE;
}
CUresult cuMemGetHandleForAddressRange(void *handle, unsigned long long ptr, unsigned long size, int type,
                                       unsigned long long flags) {
  (void)handle; (void)ptr; (void)size; (void)type; (void)flags; return CUDA_ERROR_NO_DEVICE;
}
CUresult cuPointerGetAttribute(void *data, int attribute, unsigned long long ptr) {
  (void)data; (void)attribute; (void)ptr; return CUDA_ERROR_NO_DEVICE;
}
CUresult cuGetErrorString(CUresult error, const char **str) { (void)error; if (str) *str = kMessage; return 0; }
CUresult cuGetErrorName(CUresult error, const char **str) {
  (void)error; if (str) *str = "CUDA_ERROR_NO_DEVICE"; return 0;
}
