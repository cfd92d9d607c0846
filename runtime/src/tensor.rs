//! Host tensors: a shape plus a flat row-major `f32` or `i32` vector. This is what the CPU backend
//! stores per buffer and what collectives move between ranks (taken out of a backend, reduced or
//! gathered, put back).
use crate::error::{Result, RuntimeError};
use parc_compiler::ir::{BufferId, DType};

/// The elements of a tensor, row-major.
#[derive(Clone, Debug, PartialEq)]
pub enum TensorData {
    F32(Vec<f32>),
    I32(Vec<i32>),
}

/// A host tensor: shape and row-major elements (`data.len() == product(shape)`).
#[derive(Clone, Debug, PartialEq)]
pub struct Tensor {
    shape: Vec<u64>,
    data: TensorData,
}

/// Number of elements of `shape`, or an error naming `id` when it does not fit in memory.
pub fn element_count(id: BufferId, shape: &[u64]) -> Result<usize> {
    let too_big = || RuntimeError::Buffer {
        id: id.0,
        what: format!("shape {shape:?} has more elements than this machine can address"),
    };
    let count = shape
        .iter()
        .try_fold(1u64, |acc, &d| acc.checked_mul(d))
        .ok_or_else(too_big)?;
    usize::try_from(count).map_err(|_| too_big())
}

/// A zero-filled vector of `len` elements, or an error (instead of an abort) when the allocation
/// fails.
fn zeroed_vec<T: Clone + Default>(id: BufferId, len: usize) -> Result<Vec<T>> {
    let mut v = Vec::new();
    v.try_reserve_exact(len).map_err(|_| RuntimeError::Buffer {
        id: id.0,
        what: format!(
            "cannot allocate {} bytes of host memory; reduce the micro-batch or shard more",
            len.saturating_mul(std::mem::size_of::<T>())
        ),
    })?;
    v.resize(len, T::default());
    Ok(v)
}

impl Tensor {
    /// A zero-filled tensor for buffer `id` (the id only names the buffer in errors).
    pub fn zeros(id: BufferId, shape: &[u64], dtype: DType) -> Result<Tensor> {
        let len = element_count(id, shape)?;
        let data = match dtype {
            DType::F32 => TensorData::F32(zeroed_vec(id, len)?),
            DType::I32 => TensorData::I32(zeroed_vec(id, len)?),
        };
        Ok(Tensor {
            shape: shape.to_vec(),
            data,
        })
    }

    pub fn shape(&self) -> &[u64] {
        &self.shape
    }

    pub fn dtype(&self) -> DType {
        match self.data {
            TensorData::F32(_) => DType::F32,
            TensorData::I32(_) => DType::I32,
        }
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        match &self.data {
            TensorData::F32(v) => v.len(),
            TensorData::I32(v) => v.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Size of the elements in bytes.
    pub fn bytes(&self) -> u64 {
        self.len() as u64 * self.dtype().bytes()
    }

    pub fn data(&self) -> &TensorData {
        &self.data
    }

    pub fn data_mut(&mut self) -> &mut TensorData {
        &mut self.data
    }

    /// The elements as f32, or None for an i32 tensor.
    pub fn as_f32(&self) -> Option<&[f32]> {
        match &self.data {
            TensorData::F32(v) => Some(v),
            TensorData::I32(_) => None,
        }
    }

    pub fn as_f32_mut(&mut self) -> Option<&mut [f32]> {
        match &mut self.data {
            TensorData::F32(v) => Some(v),
            TensorData::I32(_) => None,
        }
    }

    /// The elements as i32, or None for an f32 tensor.
    pub fn as_i32(&self) -> Option<&[i32]> {
        match &self.data {
            TensorData::I32(v) => Some(v),
            TensorData::F32(_) => None,
        }
    }

    pub fn as_i32_mut(&mut self) -> Option<&mut [i32]> {
        match &mut self.data {
            TensorData::I32(v) => Some(v),
            TensorData::F32(_) => None,
        }
    }

    /// Set every element to zero.
    pub fn fill_zero(&mut self) {
        match &mut self.data {
            TensorData::F32(v) => v.fill(0.0),
            TensorData::I32(v) => v.fill(0),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn zeros_has_shape_dtype_and_zero_elements() {
        let t = Tensor::zeros(BufferId(3), &[2, 3], DType::I32).unwrap();
        assert_eq!(t.shape(), &[2, 3]);
        assert_eq!(t.dtype(), DType::I32);
        assert_eq!(t.as_i32().unwrap(), &[0; 6]);
        assert!(t.as_f32().is_none());
        assert_eq!(t.bytes(), 24);
    }

    #[test]
    fn absurd_shapes_are_errors_not_aborts() {
        let err = Tensor::zeros(BufferId(7), &[u64::MAX, 4], DType::F32).unwrap_err();
        assert!(err.to_string().contains("buffer 7"), "{err}");
    }
}
