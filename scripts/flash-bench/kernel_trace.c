// Every kernel a process runs, as the GPU ran it: CUPTI's concurrent-kernel records (start and
// end on the GPU's clock, grid, graph node), written one line each to $KERNEL_TRACE_OUT at exit.
// Loaded into any CUDA program by CUDA_INJECTION64_PATH, so a captured graph's nodes are timed
// with their overlapped launches intact, which events between kernels and ncu's serialized
// replays do not give (scripts/flash-bench/step-trace builds it and reads the lines). With
// $KERNEL_TRACE_COPIES set, every copy too, one line each there: start, end, bytes, CUPTI's
// copy kind (1 host to device, 2 device to host, 8 device to device).
#include <cupti.h>
#include <stdio.h>
#include <stdlib.h>

#ifndef KERNEL_RECORD
#define KERNEL_RECORD CUpti_ActivityKernel9
#endif
#ifndef MEMCPY_RECORD
#define MEMCPY_RECORD CUpti_ActivityMemcpy6
#endif

static FILE* out;
static FILE* copies;

static void CUPTIAPI give_buffer(uint8_t** buffer, size_t* size, size_t* max_records) {
    *size = (size_t)16 << 20;
    *buffer = aligned_alloc(8, *size);
    *max_records = 0;
}

static void CUPTIAPI take_buffer(CUcontext ctx, uint32_t stream, uint8_t* buffer, size_t size, size_t valid) {
    (void)ctx; (void)stream; (void)size;
    CUpti_Activity* record = NULL;
    while (cuptiActivityGetNextRecord(buffer, valid, &record) == CUPTI_SUCCESS) {
        if (record->kind == CUPTI_ACTIVITY_KIND_MEMCPY && copies) {
            const MEMCPY_RECORD* c = (const MEMCPY_RECORD*)record;
            fprintf(copies, "%llu %llu %llu %d\n", (unsigned long long)c->start, (unsigned long long)c->end,
                    (unsigned long long)c->bytes, (int)c->copyKind);
            continue;
        }
        if (record->kind != CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL && record->kind != CUPTI_ACTIVITY_KIND_KERNEL) continue;
        const KERNEL_RECORD* k = (const KERNEL_RECORD*)record;
        fprintf(out, "%llu %llu %d %d %d %d %llu %s\n", (unsigned long long)k->start, (unsigned long long)k->end,
                k->gridX, k->gridY, k->gridZ, k->blockX, (unsigned long long)k->graphNodeId, k->name ? k->name : "?");
    }
    free(buffer);
}

static void flush(void) {
    cuptiActivityFlushAll(1);
    if (out) fclose(out);
    if (copies) fclose(copies);
}

int InitializeInjection(void) {
    const char* path = getenv("KERNEL_TRACE_OUT");
    out = fopen(path ? path : "/tmp/kernel-trace.txt", "w");
    if (!out) return 0;
    if (cuptiActivityRegisterCallbacks(give_buffer, take_buffer) != CUPTI_SUCCESS) return 0;
    if (cuptiActivityEnable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL) != CUPTI_SUCCESS) return 0;
    const char* copies_path = getenv("KERNEL_TRACE_COPIES");
    if (copies_path && (copies = fopen(copies_path, "w")) && cuptiActivityEnable(CUPTI_ACTIVITY_KIND_MEMCPY) != CUPTI_SUCCESS) {
        fclose(copies);
        copies = NULL;
    }
    atexit(flush);
    return 1;
}
