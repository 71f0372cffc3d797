/*
 * nrt_deepinfer.h: the part of the AWS Neuron runtime (libnrt) C API that
 * neuron-sys uses, declared by the deepinfer project itself.
 *
 * This is not a copy of AWS's headers (those are "All Rights Reserved" and are
 * never vendored here). Every declaration below restates a published fact: the
 * function signatures, enum values and struct layouts of the libnrt API as the
 * Neuron runtime API reference documents them, for LP64 Linux (x86_64,
 * aarch64). The reference revision is the one shipped with Neuron SDK 2.28
 * (runtime headers 2.29+/2.34); where older runtimes differ, a comment says so.
 *
 * Two modes:
 *   - default: the declarations below. neuron-sys/src/bindings.rs is bindgen's
 *     output for this mode, committed; scripts/check_bindings.sh regenerates it
 *     and diffs.
 *   - NRT_DEEPINFER_SYSTEM_HEADERS defined: the installed SDK headers
 *     (<nrt/...>, found through -I) replace our declarations, and only the
 *     function-pointer typedefs at the end of this file are ours. neuron-sys's
 *     build.rs uses this mode (feature `bindgen`) so that a signature or layout
 *     that drifted in the installed runtime shows up as a compile error.
 *
 * neuron-sys loads libnrt with dlopen/dlsym, so it never links against the
 * prototypes; it uses the `<function>_fn` pointer types, which are derived from
 * the prototypes with __typeof__ (a GNU C extension that gcc and clang accept)
 * so that the signature is written once.
 */
#ifndef NRT_DEEPINFER_H
#define NRT_DEEPINFER_H

#include <stddef.h>
#include <stdint.h>

#ifdef NRT_DEEPINFER_SYSTEM_HEADERS

/* The installed headers. nrt_version.h uses uint64_t without including
 * <stdint.h>, hence the includes above. */
#include <stdbool.h>
#include <nrt/nrt.h>
#include <nrt/nrt_status.h>
#include <nrt/nrt_experimental.h>
#if defined(__has_include)
#if __has_include(<nrt/nrt_version.h>)
#include <nrt/nrt_version.h>
#endif
#endif

#else /* !NRT_DEEPINFER_SYSTEM_HEADERS */

/* ------------------------------------------------------------------------ */
/* Status codes                                                             */
/* ------------------------------------------------------------------------ */

/**
 * Status returned by most libnrt calls. A C enum whose values are all >= 0, so
 * an unsigned 32-bit integer. Codes are appended across releases: treat any
 * value not listed here as an unknown failure. 8 and 12 are not used.
 */
typedef enum {
    NRT_SUCCESS = 0,
    NRT_FAILURE = 1,
    NRT_INVALID = 2,
    NRT_INVALID_HANDLE = 3,
    NRT_RESOURCE = 4,
    NRT_TIMEOUT = 5,
    NRT_HW_ERROR = 6,
    NRT_QUEUE_FULL = 7,
    NRT_LOAD_NOT_ENOUGH_NC = 9,
    NRT_UNSUPPORTED_NEFF_VERSION = 10,
    NRT_FAIL_HOST_MEM_ALLOC = 11,
    NRT_UNINITIALIZED = 13,
    NRT_CLOSED = 14,
    NRT_QUEUE_EMPTY = 15,
    NRT_EXEC_UNIT_UNRECOVERABLE = 101,
    NRT_EXEC_BAD_INPUT = 1002,
    NRT_EXEC_COMPLETED_WITH_NUM_ERR = 1003,
    NRT_EXEC_COMPLETED_WITH_ERR = 1004,
    NRT_EXEC_NC_BUSY = 1005,
    NRT_EXEC_OOB = 1006,
    NRT_COLL_PENDING = 1100,
    NRT_EXEC_HW_ERR_COLLECTIVES = 1200,
    NRT_EXEC_HW_ERR_HBM_UE = 1201,
    NRT_EXEC_HW_ERR_NC_UE = 1202,
    NRT_EXEC_HW_ERR_DMA_ABORT = 1203,
    NRT_EXEC_SW_NQ_OVERFLOW = 1204,
    NRT_EXEC_HW_ERR_REPAIRABLE_HBM_UE = 1205,
    NRT_NETWORK_PROXY_FAILURE = 1206,
} NRT_STATUS;

/* ------------------------------------------------------------------------ */
/* Handles                                                                  */
/* ------------------------------------------------------------------------ */

/** A loaded NEFF. Opaque; only ever handled through a pointer. */
typedef struct nrt_model nrt_model_t;

/** A block of device or host memory with a byte size (no dtype, no shape). Opaque. */
typedef struct nrt_tensor nrt_tensor_t;

/** A name -> tensor map that does not own its tensors. The C type is `void`. */
typedef void nrt_tensor_set_t;

/* ------------------------------------------------------------------------ */
/* Enums                                                                    */
/* ------------------------------------------------------------------------ */

/** Where nrt_tensor_allocate puts a tensor. */
typedef enum {
    /** Device (HBM) memory of one NeuronCore. */
    NRT_TENSOR_PLACEMENT_DEVICE = 0,
    /** DMA-able host memory (deprecated, at most 4 MB). */
    NRT_TENSOR_PLACEMENT_HOST = 1,
    /** Host virtual memory (legacy; absent from some headers). */
    NRT_TENSOR_PLACEMENT_VIRTUAL = 2,
} nrt_tensor_placement_t;

/** The framework that calls nrt_init. A standalone engine passes NO_FW. */
typedef enum {
    NRT_FRAMEWORK_TYPE_INVALID = 0,
    NRT_FRAMEWORK_TYPE_NO_FW = 1,
    NRT_FRAMEWORK_TYPE_TENSORFLOW = 2,
    NRT_FRAMEWORK_TYPE_PYTORCH = 3,
    NRT_FRAMEWORK_TYPE_MXNET = 4,
    NRT_FRAMEWORK_TYPE_PRECHECK = 5, /* 2026 headers: neuron node precheck */
} nrt_framework_type_t;

/** Whether a NEFF tensor is an input or an output. */
typedef enum nrt_tensor_usage {
    NRT_TENSOR_USAGE_INPUT = 0,
    NRT_TENSOR_USAGE_OUTPUT = 1,
} nrt_tensor_usage_t;

/**
 * Element type code of a NEFF tensor, kept raw. Two incompatible encodings
 * exist: runtime headers up to 2.29.x number the types sequentially
 * (FLOAT32 = 1, ..., UINT64 = 11); later ones use hardware codes
 * (FLOAT32 = 0xA, UINT64 = 0x1, ...). neuron-sys's sys::dtype module has both
 * tables.
 */
typedef uint32_t nrt_dtype_t;

/* ------------------------------------------------------------------------ */
/* Structs (LP64 sizes and offsets in the comments)                         */
/* ------------------------------------------------------------------------ */

/** Length of nrt_tensor_info_t.name, including the terminating NUL. */
#define NRT_TENSOR_NAME_MAX 256

/** One input or output of a loaded NEFF. 296 bytes, 8-aligned. */
typedef struct nrt_tensor_info {
    /** @0: NUL-terminated tensor name. */
    char name[NRT_TENSOR_NAME_MAX];
    /** @256: input or output (4 bytes of padding follow). */
    nrt_tensor_usage_t usage;
    /** @264: size in bytes. */
    size_t size;
    /** @272: raw element type code (4 bytes of padding follow). */
    nrt_dtype_t dtype;
    /** @280: `ndim` dimensions, owned by libnrt until nrt_free_model_tensor_info. */
    uint32_t *shape;
    /** @288: number of dimensions (4 bytes of padding follow). */
    uint32_t ndim;
} nrt_tensor_info_t;

/** What nrt_get_model_tensor_info returns: a count and that many entries. */
typedef struct nrt_tensor_info_array {
    /** @0: number of entries. */
    uint64_t tensor_count;
    /** @8: the entries (flexible array member), in no documented order. */
    nrt_tensor_info_t tensor_array[];
} nrt_tensor_info_array_t;

/** Length of nrt_version_t.rt_detail. */
#define RT_VERSION_DETAIL_LEN 128
/** Length of nrt_version_t.git_hash. */
#define GIT_HASH_LEN 64

/** The runtime library's version. 224 bytes, 8-aligned. */
typedef struct nrt_version {
    /** @0 */
    uint64_t rt_major;
    /** @8 */
    uint64_t rt_minor;
    /** @16 */
    uint64_t rt_patch;
    /** @24 */
    uint64_t rt_maintenance;
    /** @32: NUL-terminated free text. */
    char rt_detail[RT_VERSION_DETAIL_LEN];
    /** @160: NUL-terminated git hash of the runtime build. */
    char git_hash[GIT_HASH_LEN];
} nrt_version_t;

/** A NeuronCore's device memory (nrt_get_vnc_memory_stats, libnrt 2.27.23 and later). 16 bytes,
    append-only: the call takes and returns the size it filled. */
typedef struct nrt_vnc_memory_stats {
    /** @0: bytes allocated on the core now. */
    size_t bytes_used;
    /** @8: bytes the core can hold. */
    size_t bytes_limit;
} nrt_vnc_memory_stats_t;

/* ------------------------------------------------------------------------ */
/* Functions                                                                */
/* ------------------------------------------------------------------------ */

/* Lifetime of the runtime. nrt_init reads the NEURON_RT_* environment. */
NRT_STATUS nrt_init(nrt_framework_type_t framework, const char *fw_version, const char *fal_version);
void nrt_close(void);

/* Models. vnc = -1 lets the runtime choose; vnc_count is deprecated (pass -1). */
NRT_STATUS nrt_load(const void *neff_bytes, size_t size, int32_t vnc, int32_t vnc_count,
                    nrt_model_t **model);
NRT_STATUS nrt_load_collectives(const void *neff_bytes, size_t size, int32_t vnc, int32_t vnc_count,
                                uint32_t ctx_device_id, uint32_t ctx_device_count,
                                nrt_model_t **model);
NRT_STATUS nrt_unload(nrt_model_t *model);

/* NeuronCore counts; callable before nrt_init. The _vnc_ spellings are the newer names. */
NRT_STATUS nrt_get_total_nc_count(uint32_t *vnc_count);
NRT_STATUS nrt_get_visible_nc_count(uint32_t *vnc_count);
NRT_STATUS nrt_get_total_vnc_count(uint32_t *vnc_count);
NRT_STATUS nrt_get_visible_vnc_count(uint32_t *vnc_count);

/* Device memory of NeuronCore vnc (local to the instance), after nrt_init. stats_size_in is
   sizeof(nrt_vnc_memory_stats_t) as the caller knows it; *stats_size_out the size filled. */
NRT_STATUS nrt_get_vnc_memory_stats(uint32_t vnc, nrt_vnc_memory_stats_t *stats, size_t stats_size_in,
                                    size_t *stats_size_out);

/* Tensor sets. Destroying a set does not free its tensors; adding under an existing name replaces. */
NRT_STATUS nrt_allocate_tensor_set(nrt_tensor_set_t **result);
void nrt_destroy_tensor_set(nrt_tensor_set_t **tensor_set);
NRT_STATUS nrt_add_tensor_to_tensor_set(nrt_tensor_set_t *tensor_set, const char *tensor_name,
                                        nrt_tensor_t *tensor);
NRT_STATUS nrt_get_tensor_from_tensor_set(nrt_tensor_set_t *tensor_set, const char *tensor_name,
                                          nrt_tensor_t **tensor);

/* Synchronous execution; tensors are bound by NEFF I/O name. */
NRT_STATUS nrt_execute(nrt_model_t *model, const nrt_tensor_set_t *input_set,
                       nrt_tensor_set_t *output_set);

/* Tensors. vnc = -1 for host placement. The name is optional and only used in logs. */
NRT_STATUS nrt_tensor_allocate(nrt_tensor_placement_t tensor_placement, int vnc, size_t size,
                               const char *name, nrt_tensor_t **tensor);
void nrt_tensor_free(nrt_tensor_t **tensor);
NRT_STATUS nrt_tensor_read(const nrt_tensor_t *tensor, void *buf, size_t offset, size_t size);
NRT_STATUS nrt_tensor_write(nrt_tensor_t *tensor, const void *buf, size_t offset, size_t size);
size_t nrt_tensor_get_size(const nrt_tensor_t *tensor);
/* Sets [offset, offset + size) of the tensor to the byte `value` on the device, with no host
   buffer crossing the bus (nrt.h). */
NRT_STATUS nrt_tensor_memset(nrt_tensor_t *tensor, uint64_t offset, int value, size_t size);
/* A zero-copy view of [offset, offset + size) of tensor_source, sharing its refcounted storage. */
NRT_STATUS nrt_tensor_allocate_slice(const nrt_tensor_t *tensor_source, size_t offset, size_t size,
                                     const char *name, nrt_tensor_t **tensor_slice);

/* Model I/O description (declared in nrt_experimental.h by the SDK). */
NRT_STATUS nrt_get_model_tensor_info(nrt_model_t *model, nrt_tensor_info_array_t **tensor_info);
NRT_STATUS nrt_free_model_tensor_info(nrt_tensor_info_array_t *tensor_info);

/* Version (nrt_version.h in recent SDKs); callable before nrt_init. Pass sizeof(nrt_version_t). */
NRT_STATUS nrt_get_version(nrt_version_t *ver, size_t size);

/* The status's name, owned by libnrt. Absent from older runtimes. */
const char *nrt_get_status_as_str(NRT_STATUS status);

#endif /* NRT_DEEPINFER_SYSTEM_HEADERS */

/* ------------------------------------------------------------------------ */
/* Function-pointer types for dlsym, derived from the prototypes above (or  */
/* from the installed headers' prototypes in system-header mode).           */
/* ------------------------------------------------------------------------ */

typedef __typeof__(nrt_init) *nrt_init_fn;
typedef __typeof__(nrt_close) *nrt_close_fn;
typedef __typeof__(nrt_load) *nrt_load_fn;
typedef __typeof__(nrt_load_collectives) *nrt_load_collectives_fn;
typedef __typeof__(nrt_unload) *nrt_unload_fn;
typedef __typeof__(nrt_get_total_nc_count) *nrt_get_total_nc_count_fn;
typedef __typeof__(nrt_get_visible_nc_count) *nrt_get_visible_nc_count_fn;
typedef __typeof__(nrt_get_total_vnc_count) *nrt_get_total_vnc_count_fn;
typedef __typeof__(nrt_get_visible_vnc_count) *nrt_get_visible_vnc_count_fn;
typedef __typeof__(nrt_allocate_tensor_set) *nrt_allocate_tensor_set_fn;
typedef __typeof__(nrt_destroy_tensor_set) *nrt_destroy_tensor_set_fn;
typedef __typeof__(nrt_add_tensor_to_tensor_set) *nrt_add_tensor_to_tensor_set_fn;
typedef __typeof__(nrt_get_tensor_from_tensor_set) *nrt_get_tensor_from_tensor_set_fn;
typedef __typeof__(nrt_execute) *nrt_execute_fn;
typedef __typeof__(nrt_tensor_allocate) *nrt_tensor_allocate_fn;
typedef __typeof__(nrt_tensor_free) *nrt_tensor_free_fn;
typedef __typeof__(nrt_tensor_read) *nrt_tensor_read_fn;
typedef __typeof__(nrt_tensor_write) *nrt_tensor_write_fn;
typedef __typeof__(nrt_tensor_get_size) *nrt_tensor_get_size_fn;
typedef __typeof__(nrt_tensor_memset) *nrt_tensor_memset_fn;
typedef __typeof__(nrt_tensor_allocate_slice) *nrt_tensor_allocate_slice_fn;
typedef __typeof__(nrt_get_model_tensor_info) *nrt_get_model_tensor_info_fn;
typedef __typeof__(nrt_free_model_tensor_info) *nrt_free_model_tensor_info_fn;
typedef __typeof__(nrt_get_version) *nrt_get_version_fn;
typedef __typeof__(nrt_get_status_as_str) *nrt_get_status_as_str_fn;
typedef __typeof__(nrt_get_vnc_memory_stats) *nrt_get_vnc_memory_stats_fn;

#endif /* NRT_DEEPINFER_H */
